"""A tiny real HTTP server on 127.0.0.1 for faking cloud endpoints (GCP, Azure, metadata servers).

A test gives it a `route(request) -> (status, body)` function; the server records every
request it saw. Bodies that are dicts/lists are sent as JSON, str/bytes as they are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body or b"null")


Reply = tuple[int, object] | tuple[int, object, dict[str, str]]


@dataclasses.dataclass
class FakeServer:
    url: str
    requests: list[Request]

    @property
    def host(self) -> str:
        return self.url.removeprefix("http://")


@contextlib.contextmanager
def serve(route: Callable[[Request], Reply]) -> Iterator[FakeServer]:
    seen: list[Request] = []

    class Handler(BaseHTTPRequestHandler):
        def _handle(self):
            parsed = urllib.parse.urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            request = Request(self.command, parsed.path, dict(urllib.parse.parse_qsl(parsed.query)),
                              {k.lower(): v for k, v in self.headers.items()}, self.rfile.read(length))
            seen.append(request)
            status, body, *extra = route(request)
            headers = extra[0] if extra else {}
            if isinstance(body, dict | list):
                payload, ctype = json.dumps(body).encode(), "application/json"
            else:
                payload = body.encode() if isinstance(body, str) else bytes(body or b"")
                ctype = "text/plain"
            self.send_response(status)
            self.send_header("Content-Type", headers.pop("Content-Type", ctype))
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            try:
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout under test)
                pass

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle

        def log_message(self, *args):  # keep test output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield FakeServer(f"http://127.0.0.1:{server.server_address[1]}", seen)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def serving(fake):
    """`fake` (an object with a `route` method) served on 127.0.0.1, its server at `fake.server`."""
    with serve(fake.route) as server:
        fake.server = server
        yield fake


# ---- price APIs: the real SDKs talk to these over HTTP ------------------------------------------


def price_list_product(instance_type: str, region: str, usd: float, sku: str | None = None) -> str:
    """One AWS Price List product as GetProducts returns it (a JSON string, format aws_v1)."""
    sku = sku or f"SKU-{instance_type}-{region}"
    return json.dumps({
        "product": {"productFamily": "Compute Instance", "sku": sku, "attributes": {
            "instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux", "tenancy": "Shared",
            "preInstalledSw": "NA", "capacitystatus": "Used", "marketoption": "OnDemand"}},
        "serviceCode": "AmazonEC2",
        "terms": {"OnDemand": {f"{sku}.JRTCKXETXF": {"offerTermCode": "JRTCKXETXF", "sku": sku, "priceDimensions": {
            f"{sku}.JRTCKXETXF.6YS6EN2CT7": {"unit": "Hrs", "beginRange": "0", "endRange": "Inf",
                                             "description": f"${usd} per On Demand Linux {instance_type} Instance Hour",
                                             "pricePerUnit": {"USD": f"{usd:.10f}"}}}}}}})


class FakePriceList:
    """The AWS Price List API (awsJson1_1 `AWSPriceListService.GetProducts`), one product per page."""

    def __init__(self, products: list[str]):
        self.products = products
        self.server: FakeServer | None = None

    def route(self, req: Request) -> Reply:
        if req.headers.get("x-amz-target") != "AWSPriceListService.GetProducts":
            return 400, {"__type": "InvalidParameterException", "message": "unknown target"}
        body = req.json()
        wanted = {f["Field"]: f["Value"] for f in body.get("Filters", [])}
        matching = [p for p in self.products
                    if all(json.loads(p)["product"]["attributes"].get(k, v) == v for k, v in wanted.items())]
        start = int(body.get("NextToken") or 0)
        page = {"FormatVersion": "aws_v1", "PriceList": matching[start:start + 1]}
        if start + 1 < len(matching):
            page["NextToken"] = str(start + 1)
        return 200, page, {"Content-Type": "application/x-amz-json-1.1"}


def billing_sku(description: str, usage: str, usd: float, regions: list[str], group: str = "GPU") -> dict:
    """A Cloud Billing Catalog Sku in its REST JSON form (int64 units travel as a string)."""
    units, nanos = int(usd), round((usd - int(usd)) * 1e9)
    sku_id = f"{abs(hash((description, usage))) % 10**12:012d}"
    return {"name": f"services/6F81-5844-456A/skus/{sku_id}", "skuId": sku_id, "description": description,
            "category": {"serviceDisplayName": "Compute Engine", "resourceFamily": "Compute",
                         "resourceGroup": group, "usageType": usage},
            "serviceRegions": regions,
            "pricingInfo": [{"pricingExpression": {"usageUnit": "h", "tieredRates": [
                {"startUsageAmount": 0, "unitPrice": {"currencyCode": "USD", "units": str(units), "nanos": nanos}}]}}]}


class FakeBillingCatalog:
    """`GET /v1/services/6F81-5844-456A/skus`, paged by pageToken, `page_size` SKUs a page."""

    def __init__(self, skus: list[dict], page_size: int = 2):
        self.skus = skus
        self.page_size = page_size
        self.server: FakeServer | None = None

    def route(self, req: Request) -> Reply:
        if req.path != "/v1/services/6F81-5844-456A/skus":
            return 404, {"error": {"code": 404, "message": f"no {req.path}"}}
        start = int(req.query.get("pageToken") or 0)
        end = start + self.page_size
        return 200, {"skus": self.skus[start:end], "nextPageToken": str(end) if end < len(self.skus) else ""}
