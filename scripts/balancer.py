#!/usr/bin/env python3
"""A stand-in for a Kubernetes Service in front of ratelimitd's replicas, for
scripts/day-two.sh: each new TCP connection on LISTEN_PORT goes, round robin, to one of the
replicas listed; one that refuses it has the client's connection closed at once (as a
connection to a pod that is gone fails). Connections made stay where they are.

Controlled on CONTROL_PORT, one command per connection, answered with one line:
  add PORT            list the replica on PORT (once its health says SERVING)
  remove PORT LAG     take it off the list LAG seconds from now (an endpoint's removal
                      reaching kube-proxy late)
  next PORT           the next new connection goes to PORT (the worst case of a random pick)
  refused             how many connections a listed replica refused

Standard library only; loopback only. Usage: balancer.py LISTEN_PORT CONTROL_PORT
"""
import asyncio
import sys

listed = []
state = {"next": 0, "refused": 0}


async def pipe(reader, writer):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except (ConnectionError, OSError):
            pass


async def client(reader, writer):
    if not listed:
        writer.close()
        return
    port = listed[state["next"] % len(listed)]
    state["next"] += 1
    try:
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        state["refused"] += 1
        writer.close()
        return
    await asyncio.gather(pipe(reader, w2), pipe(r2, writer))


async def remove_later(port, lag):
    await asyncio.sleep(lag)
    if port in listed:
        listed.remove(port)


async def control(reader, writer):
    words = (await reader.readline()).decode().split()
    answer = "ok"
    if words[:1] == ["add"]:
        listed.append(int(words[1]))
    elif words[:1] == ["remove"]:
        asyncio.ensure_future(remove_later(int(words[1]), float(words[2])))
    elif words[:1] == ["next"] and int(words[1]) in listed:
        state["next"] = listed.index(int(words[1]))
    elif words[:1] == ["refused"]:
        answer = str(state["refused"])
    else:
        answer = "unknown command"
    writer.write((answer + "\n").encode())
    await writer.drain()
    writer.close()


async def main():
    listen, ctl = int(sys.argv[1]), int(sys.argv[2])
    await asyncio.start_server(client, "127.0.0.1", listen)
    await asyncio.start_server(control, "127.0.0.1", ctl)
    await asyncio.Event().wait()


asyncio.run(main())
