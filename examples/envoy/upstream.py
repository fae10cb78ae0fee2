#!/usr/bin/env python3
"""A tiny upstream for the Envoy examples: answers every request 200 on 127.0.0.1:9000.

Each answer says in `x-tokens-used` what it "used", as an LLM backend would report tokens: the
request's `x-fake-tokens` header if it has one, else 4000 (the figure token-budget.yaml's
comments walk through). token-budget.yaml and reservations.yaml charge that figure to the
tenant's budget when the stream is done; the other examples ignore the header. A request's
`x-delay-ms` header (at most 60,000) holds its answer that long, as a long LLM stream would hold
its place (concurrency.yaml). Request headers named x-llm-* or x-ratelimit-* come back as
x-upstream-saw-<name> (what a soft limit told the upstream, llm-api.yaml).

One thread per connection, a listen backlog of 1,024 (Python's default is 5, which stalls
connections for seconds under a load generator's burst), and TCP_NODELAY (40 ms an answer
without it).

    python3 examples/envoy/upstream.py            # 127.0.0.1:9000
    python3 examples/envoy/upstream.py 9100       # another port
"""

import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEFAULT_TOKENS = 4000
# Request headers a rate-limit answer may add for the upstream (llm-api.yaml's soft limit), sent
# back as x-upstream-saw-<name> so that a client can see what the upstream was told.
ECHOED = ("x-llm-", "x-ratelimit-")
LONGEST_DELAY_MS = 60_000


class Server(ThreadingHTTPServer):
    request_queue_size = 1024
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client gone mid-answer (a load generator stopping) is not an error worth a trace.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # The head and the body leave in two writes: without TCP_NODELAY the body waits for the
    # peer's delayed ACK, 40 ms an answer.
    disable_nagle_algorithm = True

    def answer(self, with_body):
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        delay = self.headers.get("x-delay-ms", "")
        if delay.isdigit():
            time.sleep(min(int(delay), LONGEST_DELAY_MS) / 1000)
        tokens = self.headers.get("x-fake-tokens", str(DEFAULT_TOKENS))
        if not tokens.isdigit():
            tokens = str(DEFAULT_TOKENS)
        body = f"ok {self.command} {self.path}: {tokens} tokens\n".encode()
        self.send_response(200)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.send_header("x-tokens-used", tokens)
        for name, value in self.headers.items():
            if name.lower().startswith(ECHOED):
                self.send_header("x-upstream-saw-" + name.lower(), value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def do_GET(self):
        self.answer(True)

    # Every method is answered, as the docstring says (BaseHTTPRequestHandler answers 501 to a
    # method it has no do_<METHOD> for).
    do_POST = do_PUT = do_PATCH = do_DELETE = do_OPTIONS = do_GET

    def do_HEAD(self):
        self.answer(False)

    def log_message(self, format, *args):
        pass


def main():
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 9000
    server = Server(("127.0.0.1", port), Handler)
    print(f"upstream on 127.0.0.1:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
