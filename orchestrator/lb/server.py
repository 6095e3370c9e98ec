"""The LB's HTTP server: uvicorn's httptools protocol, writing each response in one syscall.

LoadBalancer.start runs uvicorn with this protocol. uvicorn writes a response's status line and
headers, then its body, as separate socket writes; on loopback each costs tens of microseconds of
TCP work, a large share of the LB's hop. Writes issued within one event-loop step are joined and
sent at the end of it, so a non-streamed response leaves in one write and a stream in one write
per chunk.
"""

from __future__ import annotations

import asyncio
import importlib.util

if importlib.util.find_spec("httptools"):  # uvicorn[standard]; h11 otherwise (slower parsing)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
else:  # pragma: no cover - depends on the installed extras
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base


class _CoalescingTransport:
    """A transport whose writes within one loop step become one write; all else delegated."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CoalescingHTTPProtocol(_Base):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, asyncio.get_running_loop()))
