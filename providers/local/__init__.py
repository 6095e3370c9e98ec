"""The `local` cloud: replicas are real local processes in simulated zones (see provider.py)."""

from providers.local.provider import INSTANCE_ID_ENV, NOTICE_FILE_ENV, LocalProvider
from providers.local.zones import CLOUD, DEFAULT_ZONES, REGION, ZonePrices, configured_locations

__all__ = ["CLOUD", "DEFAULT_ZONES", "INSTANCE_ID_ENV", "NOTICE_FILE_ENV", "REGION", "LocalProvider", "ZonePrices",
           "configured_locations"]
