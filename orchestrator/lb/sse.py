"""Server-sent events, as OpenAI-style servers stream them: split bytes into events' data (the
load balancer reads its replicas' streams with SSESplitter and writes events with sse_event).
"""

from __future__ import annotations

DONE = b"[DONE]"


class SSESplitter:
    """Feed raw bytes as they arrive; get back the `data` payload of each complete event.

    Events end with a blank line. Comments and fields other than `data` (vLLM sends none) are
    dropped; multi-line data is joined with newlines as the SSE spec says.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        out = []
        for event in events:
            data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
        return out


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = sse_event(DONE)
