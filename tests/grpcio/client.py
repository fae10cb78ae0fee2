"""A grpc-core client (Python's grpcio) for tests/grpcio.rs: the client stack of Envoy's
C++ peers, Ruby and PHP, whose connection handling differs from tonic's.

Reads one JSON object on stdin:
  target     "127.0.0.1:8081" or "unix:///path/to.sock"
  method     "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
  request    the serialized request message, hex
  channels   channels, each its own connection (default 1)
  in_flight  calls each channel keeps in flight (default 1)
  seconds    how long to keep calling (default: one call per slot)
  timeout    each call's deadline, seconds (default 10)
  options    channel options, e.g. [["grpc.default_authority", "localhost"]]
and prints one JSON object: {"ok": n, "codes": {"UNAVAILABLE": n, ...},
"details": [first few error details], "response": hex of the last answer,
"answered_seconds": how many distinct whole seconds since the start saw an answer}.
"""

import json
import sys
import threading
import time

import grpc


def main():
    spec = json.load(sys.stdin)
    request = bytes.fromhex(spec["request"])
    options = [tuple(o) for o in spec.get("options", [])]
    seconds = spec.get("seconds")
    timeout = spec.get("timeout", 10)
    deadline = time.monotonic() + seconds if seconds else None
    lock = threading.Lock()
    out = {"ok": 0, "codes": {}, "details": [], "response": ""}
    started = time.monotonic()
    answered = set()

    def slot(channel):
        call = channel.unary_unary(spec["method"])
        while True:
            try:
                answer = call(request, timeout=timeout)
                with lock:
                    out["ok"] += 1
                    out["response"] = answer.hex()
                    answered.add(int(time.monotonic() - started))
            except grpc.RpcError as e:
                with lock:
                    name = e.code().name
                    out["codes"][name] = out["codes"].get(name, 0) + 1
                    if len(out["details"]) < 5:
                        out["details"].append(f"{name}: {e.details()}")
            if deadline is None or time.monotonic() >= deadline:
                return

    channels = [
        grpc.insecure_channel(spec["target"], options=options)
        for _ in range(spec.get("channels", 1))
    ]
    threads = [
        threading.Thread(target=slot, args=(c,))
        for c in channels
        for _ in range(spec.get("in_flight", 1))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in channels:
        c.close()
    out["answered_seconds"] = len(answered)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
