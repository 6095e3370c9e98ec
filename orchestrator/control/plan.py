"""The launches a spec would get, without launching anything: `spotctl up --dry-run`.

Offline: each cloud's offers come from its price snapshot (`Provider.snapshot_offers`, no
credentials, no network), and the spec's own placement policy is asked, as the controller
would ask it, until it wants no more replicas. Each planned replica is carried out exactly as
the controller would (`decisions.offer_for`, the launcher), so the instance type, price and
boot script shown are the ones a real `up` would send. Needs no daemon and starts none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from orchestrator.common.errors import UserError
from orchestrator.control.boot import BootScripts
from orchestrator.control.launch import ReplicaLauncher
from orchestrator.control.store import ReplicaRow
from orchestrator.control.wheel import DISTRIBUTION, version
from orchestrator.fleet import decisions
from orchestrator.spec import ServiceSpec
from policies.base import EventKind, MarketEvent, PlacementPolicy, UnknownPolicyError, load_policy
from providers import registry
from providers.base import Offer, Offers, Provider

MAX_ROUNDS = 16  # a policy that keeps asking for more than this is reported, not looped on
DRY_RUN_URL = "https://daemon.invalid:8470"  # stands in for the daemon's public URL


@dataclasses.dataclass(frozen=True)
class PlannedLaunch:
    replica: str
    cloud: str
    region: str
    zone: str
    instance_type: str
    accelerator: str
    accelerator_count: int
    market: str
    price_per_hour: float
    price_source: str
    price_age_s: float | None
    boot_script_bytes: int | None  # None: the machine runs on this host, with no boot script
    reason: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _offers(spec: ServiceSpec, provider_class: Callable[[str], type[Provider]]) -> Offers:
    clouds = spec.clouds() or [registry.DEFAULT_CLOUD]
    wanted = spec.accelerators_wanted() or [(None, None)]
    out = Offers()
    for cloud in clouds:
        registry.check(cloud)
        cls = provider_class(cloud)
        out += [o for name, count in wanted for o in cls.snapshot_offers(name, count)]
    return out


def plan(spec: ServiceSpec, *, provider_class: Callable[[str], type[Provider]] = registry.provider_class,
         policy: PlacementPolicy | None = None, now: float | None = None) -> list[PlannedLaunch]:
    """The replicas `up` would launch first, in order. Raises UserError for an unknown cloud or
    policy, and when the spec's locations have no offer for its accelerator."""
    now = time.time() if now is None else now
    try:
        policy = policy or load_policy(spec.service.placement_policy)
    except UnknownPolicyError as err:
        raise UserError(f"service.placement_policy: {err}") from None
    offers = _offers(spec, provider_class)
    known = sorted({o.location for o in offers if decisions.fits(o, spec)})
    locations = spec.candidate_locations(known)
    book = decisions.price_book(offers, locations)
    if not book:
        what = ", ".join(f"{n}:{c}" for n, c in spec.accelerators_wanted()) or "any accelerator"
        raise UserError(f"resources: no offer for {what} in the spec's locations "
                        f"({', '.join(spec.clouds()) or registry.DEFAULT_CLOUD}); see `spotctl prices`")
    wheel = f"{DISTRIBUTION.replace('-', '_')}-{version()}-py3-none-any.whl"  # named, not built
    launcher = ReplicaLauncher(daemon_url=DRY_RUN_URL,
                               boot=BootScripts(DRY_RUN_URL, lambda service, replica: "x" * 43, lambda: wheel))
    views, planned = [], []
    for _ in range(MAX_ROUNDS):
        view = decisions.policy_input(now=now, target=spec.min_replicas, replicas=views, locations=locations,
                                      offers=book, params=spec.policy_params())
        launches = decisions.plan(policy.decide(view), lambda _rid: None).launches
        if not launches:
            return planned
        for launch in launches:
            offer = decisions.offer_for(launch, book, spec)
            if offer is None:
                continue
            replica = f"{spec.name}-{len(planned) + 1}"
            planned.append(_planned(spec, replica, offer, launch.reason, launcher, provider_class, now))
            # As the controller would see it once the cloud granted the launch.
            views.append(decisions.replica_view(replica, offer.location, offer.market,
                                                decisions.LAUNCH_GRANTED.state, now))
            policy.observe(MarketEvent(EventKind.LAUNCHED, offer.location, offer.market, now, replica))
    raise UserError(f"service.placement_policy: {policy.name} still asked for replicas after {MAX_ROUNDS} rounds")


def _planned(spec: ServiceSpec, replica: str, offer: Offer, reason: str, launcher: ReplicaLauncher,
             provider_class: Callable[[str], type[Provider]], now: float) -> PlannedLaunch:
    cls = provider_class(offer.location.cloud)
    row = ReplicaRow(replica_id=replica, service=spec.name, index=0, cloud=offer.location.cloud,
                     region=offer.location.region, zone=offer.location.zone, market=offer.market.value)
    boot = None
    if not cls.machines_on_this_host:
        boot = len(launcher.request(spec, row, offer, cls.vm_runtime()).boot_script.encode())
    return PlannedLaunch(
        replica=replica, cloud=offer.location.cloud, region=offer.location.region, zone=offer.location.zone,
        instance_type=offer.instance_type, accelerator=offer.accelerator, accelerator_count=offer.accelerator_count,
        market=offer.market.value, price_per_hour=round(offer.price_per_hour, 6), price_source=offer.source or "",
        price_age_s=round(max(0.0, now - offer.observed_at), 1) if offer.observed_at else None, boot_script_bytes=boot,
        reason=reason,
    )


def total_per_hour(launches: Sequence[PlannedLaunch]) -> float:
    return round(sum(p.price_per_hour for p in launches), 6)
