"""The price book, SkyPilot's catalog as we seed and refresh it (and the list prices it must
give), and the daemon's refresh job (real SQLite)."""

from __future__ import annotations

import time

import pytest
from sqlmodel import SQLModel, create_engine

from providers.catalog import loader as catalog
from orchestrator.control.pricebook import PriceBook, load_history, record_history, refresh_prices, snapshot_offers
from orchestrator.control.store import Store
from providers.azure import AzureProvider
from providers.base import Location, Market, Offer
from providers.gcp import GCPProvider
from tests.fakes.clouds import serve

ON_DEMAND, SPOT = Market.ON_DEMAND, Market.SPOT

A = Location("gcp", "us-central1", "us-central1-a")
B = Location("gcp", "us-central1", "us-central1-b")
C = Location("aws", "us-east-1", "us-east-1a")
D = Location("azure", "eastus", "eastus")


def _offer(loc, price, itype="a2-highgpu-1g", market=Market.SPOT, at=1000.0, gpu="A100", n=1) -> Offer:
    return Offer(loc, itype, gpu, n, market, price, at)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_latest_quote_wins_and_history_keeps_changes():
    clock = Clock()
    book = PriceBook(clock=clock)
    assert book.update([_offer(A, 1.0, at=100.0)]) != []
    assert book.update([_offer(A, 1.0, at=200.0)]) == []  # same price: not a change
    assert book.update([_offer(A, 0.9, at=50.0)]) == []  # older than what we have: ignored
    assert book.update([_offer(A, 1.2, at=300.0)])[0].price_per_hour == 1.2
    assert book.latest(A, "a2-highgpu-1g", Market.SPOT).price_per_hour == 1.2
    assert [o.price_per_hour for o in book.history(A, "a2-highgpu-1g")] == [1.0, 1.2]
    assert len(book) == 1


def test_cheapest_k_distinct_locations():
    book = PriceBook(clock=Clock())
    book.update([_offer(A, 0.5), _offer(A, 0.4, itype="a2-other"), _offer(B, 0.6), _offer(C, 0.45),
                 _offer(D, 0.3, market=Market.ON_DEMAND), _offer(D, 0.2, n=2)])
    got = book.cheapest("a100", 1, k=2)
    assert [(o.location, o.price_per_hour) for o in got] == [(A, 0.4), (C, 0.45)]  # A once, its cheapest type
    assert [o.location for o in book.cheapest("A100", 1, k=5)] == [A, C, B]
    assert [o.location for o in book.cheapest("A100", 1, k=5, exclude=[A])] == [C, B]
    assert [o.location for o in book.cheapest("A100", 1, k=5, clouds=["gcp"])] == [A, B]
    assert [o.location for o in book.cheapest("A100", 1, k=5, market=Market.ON_DEMAND)] == [D]
    assert book.cheapest("H100", 1, k=3) == []
    book.update([_offer(B, 0.1, at=1001.0)])  # the ranking follows updates
    assert book.cheapest("A100", 1, k=1)[0].location == B


def test_staleness():
    clock = Clock(10_000.0)
    book = PriceBook(stale_after_s=600, clock=clock)
    book.update([_offer(A, 0.5, at=9_000.0), _offer(B, 0.6, at=9_900.0)])
    assert [o.location for o in book.stale()] == [A]
    assert book.is_stale(book.latest(A, "a2-highgpu-1g", Market.SPOT))
    assert book.age(book.latest(B, "a2-highgpu-1g", Market.SPOT)) == 100.0
    assert [o.location for o in book.cheapest("A100", 1, k=5, max_age_s=600)] == [B]
    assert [o.location for o in book.offers("A100", 1, max_age_s=600)] == [B]


def test_offers_filters_cheapest_first():
    book = PriceBook(clock=Clock())
    book.update([_offer(A, 0.5), _offer(C, 0.45), _offer(D, 3.0, itype="Standard_ND96asr_v4", n=8),
                 _offer(A, 0.9, market=Market.ON_DEMAND)])
    assert [o.price_per_hour for o in book.offers()] == [0.45, 0.5, 0.9, 3.0]
    assert [o.location for o in book.offers("A100", 1, market=Market.SPOT)] == [C, A]
    assert [o.location for o in book.offers(clouds=["azure"])] == [D]
    assert [o.location for o in book.offers(regions=["us-east-1"])] == [C]


def test_snapshot_covers_three_clouds_with_spot_below_on_demand():
    offers, sources = snapshot_offers()
    assert {o.location.cloud for o in offers} == {"aws", "gcp", "azure"} and len(sources) == 3
    book = PriceBook()
    book.update(offers)
    for o in book.offers(market=Market.SPOT):
        od = book.latest(o.location, o.instance_type, Market.ON_DEMAND)
        assert od is not None and o.price_per_hour < od.price_per_hour, o
    assert book.cheapest("A100", 1, k=3)  # the policy's question has answers offline


@pytest.mark.parametrize(("cloud", "itype", "gpu"), [
    ("aws", "p4d.24xlarge", ("A100", 8)), ("aws", "g6.xlarge", ("L4", 1)), ("aws", "m5.large", None),
    ("gcp", "a2-highgpu-1g", ("A100", 1)), ("gcp", "a2-ultragpu-8g", ("A100-80GB", 8)),
    ("gcp", "g2-standard-48", ("L4", 4)), ("gcp", "n1-standard-8+T4x2", ("T4", 2)), ("gcp", "n2-standard-8", None),
    ("azure", "Standard_NC24ads_A100_v4", ("A100-80GB", 1)), ("azure", "Standard_ND96isr_H100_v5", ("H100", 8)),
])
def test_gpu_catalog(cloud, itype, gpu):
    assert catalog.accelerator_for(cloud, itype) == gpu


# Public on-demand list prices (USD/h, Linux): GCP's VM pricing page (a2-highgpu-1g 3.67, g2-standard-4
# 0.71), AWS's EC2 on-demand page after the June 2025 P4/P5 cut (p4d.24xlarge 21.96, was 32.77;
# p3.2xlarge 3.06), Azure's Linux VM pricing (NC24ads A100 v4 3.67, NC4as T4 v3 0.526).
LIST_PRICES = [
    ("gcp", "us-central1", "a2-highgpu-1g", 3.67),
    ("gcp", "us-central1", "g2-standard-4", 0.707),
    ("aws", "us-east-1", "p4d.24xlarge", 21.96),
    ("aws", "us-east-1", "p3.2xlarge", 3.06),
    ("azure", "eastus", "Standard_NC24ads_A100_v4", 3.67),
    ("azure", "eastus", "Standard_NC4as_T4_v3", 0.526),
]


@pytest.mark.parametrize(("cloud", "region", "itype", "list_price"), LIST_PRICES)
def test_snapshot_on_demand_prices_are_public_list_prices(cloud, region, itype, list_price):
    quotes = {o.price_per_hour for o in catalog.catalog_offers(cloud)
              if o.location.region == region and o.instance_type == itype and o.market is ON_DEMAND}
    assert len(quotes) == 1, quotes  # one on-demand price per region, in every zone
    assert quotes.pop() == pytest.approx(list_price, rel=0.05)


def test_gcp_offers_are_the_host_row_plus_the_gpu_row():
    host = catalog.host_price("gcp", "a2-highgpu-1g", "us-central1", "us-central1-a", ON_DEMAND)
    offer = next(o for o in catalog.catalog_offers("gcp", "A100", 1) if o.location == A and o.market is ON_DEMAND
                 and o.instance_type == "a2-highgpu-1g")
    assert host == pytest.approx(0.73948)  # the host row alone is a fifth of the machine
    assert offer.price_per_hour == pytest.approx(host + 2.93391) and offer.source == catalog.SOURCE_SNAPSHOT
    attached = {o.instance_type for o in catalog.catalog_offers("gcp", "T4")}
    assert attached and all(catalog.parse_attached(t) for t in attached)  # n1 hosts with the GPUs attached


@pytest.mark.parametrize("cloud", catalog.CLOUDS)
def test_every_catalog_offer_has_spot_below_on_demand(cloud):
    offers = catalog.catalog_offers(cloud)
    od = {(o.location, o.instance_type): o.price_per_hour for o in offers if o.market is ON_DEMAND}
    spot = [o for o in offers if o.market is SPOT]
    assert len(spot) > 0.8 * len(od)
    assert all(o.price_per_hour < od[(o.location, o.instance_type)] for o in spot)
    assert all(o.observed_at == catalog.SHIPPED_SNAPSHOT_AT for o in offers)


def test_seed_fills_only_missing_files_and_leaves_sky_no_md5(tmp_path):
    assert catalog.seed(tmp_path) == list(catalog.CLOUDS)
    assert (tmp_path / "gcp" / "vms.csv").read_bytes() == (catalog.SHIPPED_DIR / "gcp" / "vms.csv").read_bytes()
    assert not (tmp_path / ".meta").exists()  # no md5: sky never pulls over these files by itself
    assert catalog.provenance("gcp", tmp_path).source == catalog.SOURCE_SNAPSHOT
    (tmp_path / "aws" / "vms.csv").write_text("InstanceType,Price\n")  # a file put there by hand
    (tmp_path / catalog._PROVENANCE).unlink()
    assert catalog.seed(tmp_path) == []
    assert (tmp_path / "aws" / "vms.csv").read_text() == "InstanceType,Price\n"
    assert catalog.provenance("aws", tmp_path).source == catalog.SOURCE_CATALOG


def test_refresh_replaces_files_atomically_and_keeps_them_on_failure(tmp_path, monkeypatch):
    fresh = ("InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,Region\n"
             "g5.xlarge,A10G,1,1.006,0.4,us-east-1\n")

    def route(req):
        if req.path == "/v8/aws/vms.csv":
            return 200, fresh
        if req.path == "/v8/azure/vms.csv":
            return 200, "<html>rate limited</html>"
        if req.path == "/v8/gcp/vms.csv":
            time.sleep(1.5)  # longer than the refresh's timeout
        return 404, "not found"

    catalog.seed(tmp_path)
    with serve(route) as server:
        monkeypatch.setenv(catalog.CATALOG_URL_ENV, server.url)
        results = catalog.refresh(root=tmp_path, timeout_s=0.3, now=1_800_000_000.0)
    assert results["aws"] is None and (tmp_path / "aws" / "vms.csv").read_text() == fresh
    assert catalog.provenance("aws", tmp_path) == catalog.Provenance(
        catalog.SOURCE_CATALOG, 1_800_000_000.0, f"{server.url}/v8/aws/vms.csv")
    assert "Timeout" in results["gcp"] and "not a SkyPilot catalog" in results["azure"]
    for cloud in ("gcp", "azure"):  # a failed refresh keeps the seeded snapshot
        assert (tmp_path / cloud / "vms.csv").read_bytes() == (catalog.SHIPPED_DIR / cloud / "vms.csv").read_bytes()
        assert catalog.provenance(cloud, tmp_path).source == catalog.SOURCE_SNAPSHOT
    assert not list(tmp_path.rglob(".vms.csv.*"))  # no temporary file left behind


def test_provenance_says_source_and_age():
    book = PriceBook(clock=Clock(1_500.0))
    quote = Offer(A, "a2-highgpu-1g", "A100", 1, SPOT, 1.8, 1_000.0, "live")
    assert book.provenance(quote) == {"source": "live", "observed_at": 1_000.0, "age_s": 500.0}
    assert book.provenance(_offer(A, 1.0))["source"] == "unknown"


# ---- history -------------------------------------------------------------------------------


def test_history_round_trip_with_an_engine_and_with_the_store(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'h.db'}")
    SQLModel.metadata.create_all(engine)
    quotes = [_offer(C, p, itype="p4d.24xlarge", at=1000.0 + i, n=8) for i, p in enumerate([9.0, 9.5, 8.7])]
    assert record_history(engine, quotes + [_offer(A, 0.4)]) == 4
    got = load_history(engine, "us-east-1a", "p4d.24xlarge")
    assert [(o.price_per_hour, o.market, o.location) for o in got] == [(9.0, Market.SPOT, C), (9.5, Market.SPOT, C),
                                                                        (8.7, Market.SPOT, C)]
    assert [o.price_per_hour for o in load_history(engine, "us-east-1a", "p4d.24xlarge", limit=2)] == [9.5, 8.7]
    assert load_history(engine, "us-east-1a", "p4d.24xlarge", market=Market.ON_DEMAND) == []
    store = Store(f"sqlite:///{tmp_path / 'state.db'}")
    record_history(store, quotes)
    assert [o.price_per_hour for o in load_history(store, "us-east-1a", "p4d.24xlarge", cloud="aws")] == [9.0, 9.5, 8.7]
    store.close()


# ---- the refresh job: real providers against fakes -------------------------------------------


def test_refresh_prices_stores_offers_and_history_and_backs_off_a_throttled_cloud(tmp_path):
    def throttled(req):
        return 429, {"error": "Too many requests"}

    store = Store(f"sqlite:///{tmp_path / 'state.db'}")
    clock = Clock(time.time())
    book = PriceBook(clock=clock)
    sleeps: list[float] = []
    gcp = GCPProvider("p", zones=["us-central1-a", "us-central1-b"])
    with serve(throttled) as server:
        azure = AzureProvider("sub", regions=["eastus"], prices_url=f"{server.url}/p", sleep=sleeps.append,
                              attempts=3)
        count = refresh_prices([gcp, azure], book, store)
        assert len(server.requests) == 3  # retried, then given up on for now
        assert count == len(book) > 0 and {o.location.cloud for o in book.offers()} == {"gcp"}
        assert book.cooling_down("azure") and not book.cooling_down("gcp")
        assert book.last_refreshed("gcp") == clock.now and book.last_refreshed("azure") is None
        refresh_prices([gcp, azure], book, store)
        assert len(server.requests) == 3  # still cooling down: not even asked
    assert len(sleeps) == 2  # the one backoff helper's delays, between the three tries
    stored = load_history(store, "us-central1-a", "a2-highgpu-1g")
    assert {o.market for o in stored} == {Market.SPOT, Market.ON_DEMAND}
    refresh_prices([gcp], book, store)
    assert len(load_history(store, "us-central1-a", "a2-highgpu-1g")) == len(stored)  # unchanged: not re-stored
    store.close()


def test_refresh_recovers_after_cool_down():
    pages = {"n": 0}

    def flaky(req):
        pages["n"] += 1
        if pages["n"] <= 2:
            return 429, {"error": "Too many requests"}
        item = {"armSkuName": "Standard_NC4as_T4_v3", "skuName": "NC4as T4 v3 Spot", "retailPrice": 0.15,
                "unitOfMeasure": "1 Hour", "armRegionName": "eastus", "productName": "Virtual Machines NCasT4_v3"}
        return 200, {"Items": [item], "NextPageLink": None}

    clock = Clock(time.time())
    book = PriceBook(clock=clock)
    with serve(flaky) as server:
        azure = AzureProvider("sub", regions=["eastus"], prices_url=f"{server.url}/p", sleep=lambda s: None,
                              attempts=2)
        assert refresh_prices({"azure": azure}, book, None) == 0
        assert book.cooling_down("azure")
        clock.now += 3600
        assert refresh_prices({"azure": azure}, book, None) == 1
    assert not book.cooling_down("azure") and book.cheapest("T4", 1)[0].price_per_hour == 0.15
