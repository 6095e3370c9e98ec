"""Client-side helpers of the load-balancer tests: SSE reading, metrics, polling."""

from __future__ import annotations

import json
import threading

import httpx

from tests import helpers


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    # Polled fast: a stream's state (in flight, chunks) changes within milliseconds.
    return helpers.wait_for(condition, timeout, what, interval=0.02)


def metric(lb_url: str, prefix: str) -> float:
    """Sum of the samples of /metrics whose line starts with `prefix`."""
    text = httpx.get(lb_url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def events(url: str, path: str, body: dict, timeout: float = 60) -> list[dict]:
    """The JSON events of one streamed request; the stream must end with [DONE]."""
    with httpx.stream("POST", url + path, json=body, timeout=timeout) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def text_of(chunks: list[dict]) -> str:
    out = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            out += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
    return out


def ids_of(chunks: list[dict]) -> list[int]:
    return [t for chunk in chunks for choice in chunk["choices"] for t in choice.get("token_ids") or ()]


class Reader(threading.Thread):
    """Streams one request in the background; `chunks` grows as events arrive."""

    def __init__(self, url: str, path: str, body: dict, timeout: float = 120):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.timeout = url, path, body, timeout
        self.chunks: list[dict] = []
        self.done = False
        self.error: BaseException | None = None
        self.status: int | None = None
        self.refusal = b""  # the body of an answer other than 200 (the LB's or a replica's error)
        self.start()

    def __repr__(self) -> str:  # what a failed assertion shows of the stream
        return (f"<Reader {self.path}: status {self.status}, {len(self.chunks)} chunks, done={self.done}, "
                f"error={self.error!r}, refusal={self.refusal[:300]!r}>")

    def run(self):
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=self.timeout) as resp:
                self.status = resp.status_code
                if resp.status_code != 200:
                    self.refusal = resp.read()
                    return
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.chunks.append(json.loads(line[6:]))
                    elif line == "data: [DONE]":
                        self.done = True
        except BaseException as err:  # reported by the test
            self.error = err
