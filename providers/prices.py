"""Live price quotes by cloud name, for callers that must not name a cloud (`spotctl prices`).

`live_offers("gcp", "A100")` builds that cloud's provider the way a price query needs it (few
retries; GCP with the Cloud Billing Catalog's REST client) and returns its offers, or None when
the cloud has no credentials configured (the caller then shows catalog prices).
"""

from __future__ import annotations

import importlib

from providers import credentials
from providers.base import Offer, Provider


def _price_provider(cloud: str, regions: list[str] | None) -> Provider:
    module = importlib.import_module(f"providers.{cloud}")
    if cloud == "aws":
        return module.AWSProvider(regions or None, attempts=2)
    if cloud == "azure":
        return module.AzureProvider(regions=regions or None, attempts=2)
    from google.cloud import billing_v1

    return module.GCPProvider(attempts=2, billing_client=billing_v1.CloudCatalogClient(transport="rest"))


def live_offers(cloud: str, gpu: str | None = None, count: int | None = None,
                regions: list[str] | None = None) -> list[Offer] | None:
    """The cloud's current offers from its price APIs; None when it has no credentials.

    Raises ValueError for an unknown cloud and ProviderError (typed) when the cloud's API fails.
    """
    if cloud not in ("aws", "gcp", "azure"):
        raise ValueError(f"cloud {cloud!r}: expected aws, gcp or azure")
    if not credentials.available(cloud):
        return None
    provider = _price_provider(cloud, regions)
    try:
        return provider.offers(gpu, count)
    finally:
        provider.close()
