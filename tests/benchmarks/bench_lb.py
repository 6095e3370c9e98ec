"""What the load balancer adds to a request: latency and throughput, direct vs proxied.

    .venv/bin/python tests/benchmarks/bench_lb.py [--requests 1500] [--concurrency 8]

Setup (three processes, so that no two of them share a GIL): a fast fake vLLM upstream
(tests/fakes/upstream.py, no token delay), the LB (this script re-run with --serve-lb,
least_load over that one replica) and the client (this process). The same request goes
either straight to the upstream or through the LB:

- latency: sequential requests on one keep-alive connection each way, interleaved
  direct/proxied so that machine noise hits both alike; added = proxied - direct percentile;
- throughput: a fixed concurrency for the same number of requests each way, in short rounds
  that alternate direct/proxied; ratio = median over rounds of proxied req/s / direct req/s
  (medians of the raw req/s are printed beside it). The load generator is a lean keep-alive
  HTTP/1.1 client (the one the LB itself uses for replicas), as wrk would be: on a 2-core
  machine the proxied run shares the cores among three busy processes and the direct one
  among two, and a heavy client takes the CPU the LB needs. The same rounds with aiohttp's
  client as the load generator are printed beside it (`aiohttp_` keys).

Non-streamed completions are the headline keys; streamed completions (16 tokens, parsed and
re-rendered by the LB for continuation) are reported beside them with a `stream_` prefix.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from tests.fakes.upstream import FakeProcess  # noqa: E402

ROUNDS = 7
UNARY = {"model": "fake", "prompt": "benchmark prompt", "max_tokens": 16, "temperature": 0}
STREAM = dict(UNARY, stream=True)


def serve_lb(port: int, upstream: str) -> None:
    from orchestrator.lb.proxy import LoadBalancer, Upstream, serve_forever

    lb = LoadBalancer("least_load")
    lb.set_replicas([Upstream("r0", upstream)])
    serve_forever(lb, "127.0.0.1", port)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one(conn: http.client.HTTPConnection, body: bytes) -> float:
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - start
    if resp.status != 200 or not data:
        raise RuntimeError(f"bad response {resp.status}: {data[:200]!r}")
    return elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(direct_port: int, lb_port: int, payload: dict, n: int) -> tuple[float, float]:
    body = json.dumps(payload).encode()
    direct = http.client.HTTPConnection("127.0.0.1", direct_port)
    proxied = http.client.HTTPConnection("127.0.0.1", lb_port)
    for _ in range(100):  # warm-up: connections, code paths
        one(direct, body)
        one(proxied, body)
    d, p = [], []
    for _ in range(n):
        d.append(one(direct, body))
        p.append(one(proxied, body))
    direct.close()
    proxied.close()
    added_p50 = (statistics.median(p) - statistics.median(d)) * 1000
    added_p99 = (percentile(p, 0.99) - percentile(d, 0.99)) * 1000
    return added_p50, added_p99


async def throughput(url: str, payload: dict, n: int, concurrency: int) -> float:
    """req/s of `concurrency` workers on keep-alive connections, with a lean HTTP/1.1 client
    (the LB's own pooled one): on two cores the load generator competes with the LB for CPU,
    and aiohttp's client alone takes most of a core (as wrk would not); see aiohttp_throughput."""
    from orchestrator.lb.upstream import UpstreamPool

    body = json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    pool = UpstreamPool()
    remaining = n

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            status, data, _type = await pool.request(url, "POST", "/v1/completions", body, headers)
            if status != 200 or not data:
                raise RuntimeError(f"status {status}: {data[:200]!r}")

    try:
        remaining = concurrency * 10  # warm-up
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        remaining = n
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)
    finally:
        pool.close()


async def aiohttp_throughput(url: str, payload: dict, n: int, concurrency: int) -> float:
    """throughput() with aiohttp's client as the load generator (a heavier client)."""
    import aiohttp

    body = json.dumps(payload).encode()
    remaining = n

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        remaining = concurrency * 10  # warm-up
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        remaining = n
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return n / (time.perf_counter() - start)


def measure(direct: str, proxied: str, direct_port: int, lb_port: int, payload: dict, n: int,
            concurrency: int) -> dict:
    added_p50, added_p99 = latency(direct_port, lb_port, payload, n)
    # Short rounds, direct and proxied back to back in alternating order: the machine is
    # shared, and a neighbour's burst should hit one round of each, not a whole side.
    out = {"added_p50_ms": round(added_p50, 3), "added_p99_ms": round(added_p99, 3)}
    for prefix, load in (("", throughput), ("aiohttp_", aiohttp_throughput)):
        ratios, direct_rps, proxied_rps = [], [], []
        for i in range(ROUNDS):
            order = (direct, proxied) if i % 2 == 0 else (proxied, direct)
            rps = {url: asyncio.run(load(url, payload, max(200, n // ROUNDS), concurrency)) for url in order}
            direct_rps.append(rps[direct])
            proxied_rps.append(rps[proxied])
            ratios.append(rps[proxied] / rps[direct])
        out |= {f"{prefix}throughput_ratio": round(statistics.median(ratios), 3),
                f"{prefix}direct_rps": round(statistics.median(direct_rps)),
                f"{prefix}proxied_rps": round(statistics.median(proxied_rps))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--serve-lb", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_lb:
        return serve_lb(args.serve_lb, args.upstream)

    upstream = FakeProcess("r0")
    lb_port = free_port()
    try:
        lb = subprocess.Popen([sys.executable, __file__, "--serve-lb", str(lb_port), "--upstream", upstream.url])
    except BaseException:
        upstream.stop()
        raise
    try:
        lb_url = f"http://127.0.0.1:{lb_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", lb_port, timeout=1)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or lb.poll() is not None:
                raise RuntimeError("the load balancer did not start")
            time.sleep(0.05)
        result = measure(upstream.url, lb_url, upstream.port, lb_port, UNARY, args.requests, args.concurrency)
        streamed = measure(upstream.url, lb_url, upstream.port, lb_port, STREAM, args.requests // 2,
                           args.concurrency)
        result.update({f"stream_{k}": v for k, v in streamed.items()})
        result.update(requests=args.requests, concurrency=args.concurrency)
        print(json.dumps(result))
    finally:
        lb.kill()
        lb.wait()
        upstream.stop()


if __name__ == "__main__":
    main()
