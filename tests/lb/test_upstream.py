"""The LB's pooled client for non-streamed requests, against raw asyncio HTTP servers whose
every byte the test decides (keep-alive, chunked bodies, stale connections, silence)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.lb.upstream import UpstreamConnectError, UpstreamError, UpstreamPool
from tests.helpers import free_port


class RawServer:
    """An HTTP/1.1 server on loopback that answers each request with `answer(n)` bytes (n: the
    request's number on this server, from 1), then keeps the connection or, after
    `close_after` requests on it, closes it."""

    def __init__(self, answer, close_after: int | None = None):
        self.answer, self.close_after = answer, close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                n += 1
                reply = self.answer(len(self.requests))
                if reply is None:  # silence
                    await asyncio.sleep(3600)
                writer.write(reply)
                await writer.drain()
                if self.close_after is not None and n >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n" + extra + b"\r\n" + body)


def run(coro):
    return asyncio.run(coro)


def test_keeps_one_connection_for_sequential_requests_and_sends_body_and_headers():
    async def main():
        async with RawServer(lambda n: ok(b'{"n": %d}' % n)) as srv:
            pool = UpstreamPool()
            answers = [await pool.request(srv.url, "POST", "/v1/completions", b'{"prompt": "x"}',
                                          {"Content-Type": "application/json", "Authorization": "Bearer s"})
                       for _ in range(5)]
            pool.close()
            return srv, answers

    srv, answers = run(main())
    assert [a[0] for a in answers] == [200] * 5
    assert [a[1] for a in answers] == [b'{"n": %d}' % n for n in range(1, 6)]
    assert answers[0][2] == b"application/json"
    assert srv.connections == 1
    first = srv.requests[0]
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer s\r\n" in first and first.endswith(b'{"prompt": "x"}')


def test_chunked_answers_and_error_statuses_come_back_whole():
    chunked = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")

    async def main():
        async with RawServer(lambda n: chunked) as srv:
            pool = UpstreamPool()
            try:
                return await pool.request(srv.url, "GET", "/v1/models", b"", {})
            finally:
                pool.close()

    assert run(main()) == (503, b"hello world", b"text/plain")


def test_a_connection_the_replica_closed_while_idle_is_replaced_transparently():
    async def main():
        async with RawServer(lambda n: ok(), close_after=1) as srv:  # closes after each answer
            pool = UpstreamPool()
            for _ in range(3):
                assert (await pool.request(srv.url, "POST", "/v1/completions", b"{}", {}))[0] == 200
                await asyncio.sleep(0.05)  # the server's close reaches the pooled connection
            pool.close()
            return srv.connections

    assert run(main()) == 3


def test_connection_close_from_the_replica_is_honoured():
    async def main():
        async with RawServer(lambda n: ok(extra=b"Connection: close\r\n")) as srv:
            pool = UpstreamPool()
            for _ in range(2):
                await pool.request(srv.url, "POST", "/", b"{}", {})
            pool.close()
            return srv.connections

    assert run(main()) == 2


def test_refused_connection_is_a_connect_error():
    async def main():
        pool = UpstreamPool(connect_timeout=2)
        await pool.request(f"http://127.0.0.1:{free_port()}", "POST", "/", b"{}", {})

    with pytest.raises(UpstreamConnectError, match="cannot connect"):
        run(main())


def test_an_answer_cut_off_midway_is_an_error_not_a_short_body():
    async def main():
        async with RawServer(lambda n: ok(b"x" * 100)[:-40], close_after=1) as srv:
            pool = UpstreamPool()
            await pool.request(srv.url, "POST", "/", b"{}", {})

    with pytest.raises(UpstreamError, match="closed"):
        run(main())


def test_a_silent_replica_times_out():
    async def main():
        async with RawServer(lambda n: None) as srv:
            pool = UpstreamPool(idle_timeout=0.3)
            await pool.request(srv.url, "POST", "/", b"{}", {})

    with pytest.raises(UpstreamError, match="no answer"):
        run(main())


def test_a_cancelled_request_never_leaves_its_connection_in_the_pool():
    async def main():
        async with RawServer(lambda n: None if n == 1 else ok()) as srv:
            pool = UpstreamPool()
            task = asyncio.ensure_future(pool.request(srv.url, "POST", "/", b"{}", {}))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            status = (await pool.request(srv.url, "POST", "/", b"{}", {}))[0]
            pool.close()
            return status, srv.connections

    assert run(main()) == (200, 2)  # the second request did not land on the half-answered connection
