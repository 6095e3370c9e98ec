"""Price book: refresh >= 50,000 offers and answer "cheapest k locations for A100:1"; one JSON line.

The book holds every zone and GPU type of the three clouds' SkyPilot catalogs (seeded from the
shipped snapshot). They have far fewer than 50,000 offers, so per-zone quotes are synthesized from them (each row is
copied into extra zones of its region with a deterministic +-25% price jitter); the output
says so (`synthesized`, `base_offers`). query_p50_ms is the policy's hot query between
refreshes; first_query_after_refresh_ms includes the lazy re-sort a refresh causes. The
baseline is a naive linear scan (filter, sort, de-duplicate locations) over the same offers
in the same run: `speedup_vs_linear_scan` is baseline p50 / ours p50.

Env: BENCH_MARKET_OFFERS (minimum offers, default 50000), BENCH_MARKET_QUERIES (default 2000).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import time

from orchestrator.control.pricebook import PriceBook, snapshot_offers
from providers.base import Location, Market, Offer

K = 5


def synthesize(base: list[Offer], minimum: int, seed: int = 7) -> list[Offer]:
    copies = max(1, math.ceil(minimum / len(base)))
    rng = random.Random(seed)
    out = []
    for i in range(copies):
        for offer in base:
            loc = offer.location if i == 0 else Location(offer.location.cloud, offer.location.region,
                                                          f"{offer.location.zone}-s{i}")
            price = offer.price_per_hour * (1 if i == 0 else rng.uniform(0.75, 1.25))
            out.append(dataclasses.replace(offer, location=loc, price_per_hour=price))
    return out


def linear_scan(offers: list[Offer], accelerator: str, count: int, k: int) -> list[Offer]:
    matching = sorted((o for o in offers if o.accelerator.lower() == accelerator.lower()
                       and o.accelerator_count == count and o.market is Market.SPOT),
                      key=lambda o: o.price_per_hour)
    seen, out = set(), []
    for offer in matching:
        if offer.location not in seen:
            seen.add(offer.location)
            out.append(offer)
            if len(out) == k:
                break
    return out


def p50_ms(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    minimum = int(os.environ.get("BENCH_MARKET_OFFERS", "50000"))
    queries = int(os.environ.get("BENCH_MARKET_QUERIES", "2000"))
    base, _ = snapshot_offers()
    offers = synthesize(base, minimum)

    book = PriceBook()
    start = time.perf_counter()
    book.update(offers)
    refresh_s = time.perf_counter() - start

    start = time.perf_counter()
    first = book.cheapest("A100", 1, k=K)
    first_query_ms = (time.perf_counter() - start) * 1000
    ours = p50_ms(lambda: book.cheapest("A100", 1, k=K), queries)
    baseline = p50_ms(lambda: linear_scan(offers, "A100", 1, K), max(20, queries // 100))
    assert [o.price_per_hour for o in first] == [o.price_per_hour for o in linear_scan(offers, "A100", 1, K)]

    # A second refresh where a tenth of the quotes moved: what the daemon's price job does.
    rng = random.Random(11)
    moved = [dataclasses.replace(o, price_per_hour=o.price_per_hour * rng.uniform(0.9, 1.1),
                                 observed_at=o.observed_at + 60) for o in rng.sample(offers, len(offers) // 10)]
    start = time.perf_counter()
    book.update(moved)
    rerefresh_s = time.perf_counter() - start

    print(json.dumps({
        "offers": len(book),
        "synthesized": len(offers) > len(base),
        "base_offers": len(base),
        "clouds": sorted({o.location.cloud for o in offers}),
        "refresh_s": round(refresh_s, 4),
        "refresh_10pct_changed_s": round(rerefresh_s, 4),
        "query": f"cheapest {K} locations for A100:1 (spot)",
        "query_p50_ms": round(ours, 5),
        "first_query_after_refresh_ms": round(first_query_ms, 3),
        "baseline_linear_scan_p50_ms": round(baseline, 3),
        "speedup_vs_linear_scan": round(baseline / ours, 1) if ours else None,
        "target_query_p50_ms": 1.0,
    }))


if __name__ == "__main__":
    main()
