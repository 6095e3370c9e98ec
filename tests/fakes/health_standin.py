"""One process that answers every replica's health check: any GET or POST gets 200 "ok", on
keep-alive connections, whatever the path (the memory cloud's machines are paths under it).
Raw asyncio on purpose: thousands of probes a second must cost this process, not the daemon.

    python tests/fakes/health_standin.py --port 0     (prints "port N" once listening)

`GET /_count` answers how many requests it has served (the benchmark's proof that probes ran).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class _Health(asyncio.Protocol):
    served = 0

    def connection_made(self, transport):
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head, sep, rest = self.buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip() or 0)
            if len(rest) < length:
                return  # the body is still coming
            self.buffer = rest[length:]
            if head.split(b" ", 2)[1:2] == [b"/_count"]:
                body = str(_Health.served).encode()
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            else:
                _Health.served += 1
                self.transport.write(OK)


async def _serve(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_Health, "127.0.0.1", port, backlog=1024)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    try:
        asyncio.run(_serve(parser.parse_args().port))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
