"""How long before a spot preemption each cloud warns, in seconds: one table for every user.

AWS sends its interruption notice two minutes ahead; GCP's preemption (ACPI soft-off) and
Azure's Scheduled Events `Preempt` give about 30 s; the local cloud's `spotctl chaos preempt`
defaults to a 30 s grace. The simulator takes its default notice from here, by the cloud a
trace belongs to. Import-light on purpose (no SDK): the simulator and tests read it.
"""

from __future__ import annotations

NOTICE_SECONDS: dict[str, float] = {"aws": 120.0, "gcp": 30.0, "azure": 30.0, "local": 30.0}
# The cloud of a trace folder whose name names none: the public spot traces are mostly AWS's.
UNNAMED_TRACE_CLOUD = "aws"


def notice_seconds(cloud: str) -> float:
    """The cloud's preemption notice; raises KeyError naming the cloud if it is unknown."""
    try:
        return NOTICE_SECONDS[cloud]
    except KeyError:
        raise KeyError(f"no preemption notice length known for cloud {cloud!r}") from None


def cloud_of_name(name: str) -> str:
    """The cloud a trace folder's name starts with (gcp-04-30-2023 -> gcp); else the default."""
    head = name.split("-", 1)[0].lower()
    return head if head in NOTICE_SECONDS else UNNAMED_TRACE_CLOUD
