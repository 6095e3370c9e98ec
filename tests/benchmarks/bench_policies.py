"""Placement policies on every shared spot-trace group: one JSON line per (group, policy),
then one summary line comparing the default policy with SpotHedge measured in the same run.

Settings (the SkyServe evaluation's): target 3 READY replicas, 120 s cold start, on-demand
= 3x spot, 120 s preemption notice (AWS's two minutes; SpotHedge ignores it, as shipped).
SpotHedge gets the replica_policy SkyServe evaluated it with: num_overprovision=1,
dynamic_ondemand_fallback=true, base_ondemand_fallback_replicas=0.

Summary keys: cost_vs_spothedge = mean over groups of (ours cost / SpotHedge cost)
(target <= 0.90); min_availability_delta = min over groups of ours - SpotHedge
availability (target >= 0); replay speed = simulated seconds per wall second on the
45-day 9-zone trace (aws-02-15-2023), for both policies.

Env: BENCH_POLICIES = comma-separated policies (default: every registered one).
"""

from __future__ import annotations

import json
import os
import sys
import time

from orchestrator.common.paths import traces_dir
from orchestrator.sim.replay import SimConfig, expand_trace_dirs, group_label, load_groups, simulate
from policies.base import DEFAULT_POLICY, available_policies, load_policy

LONG_TRACE = "aws-02-15-2023"


def main() -> int:
    root = traces_dir()
    if not root.is_dir() or not any(root.rglob("*.json")):
        print(json.dumps({"summary": True, "skipped": f"no spot traces at {root} (set SPOT_TRACES_DIR)"}))
        return 0
    names = [n for n in os.environ.get("BENCH_POLICIES", "").split(",") if n] or list(available_policies())
    for must in ("spothedge", DEFAULT_POLICY):
        if must not in names:
            names.append(must)
    cfg = SimConfig()
    by_group: dict[str, dict] = {}
    speed: dict[str, float] = {}
    for folder, found_under in expand_trace_dirs([root]):
        for group in load_groups(folder):
            label = group_label(group, folder, found_under)
            for name in names:
                t0 = time.perf_counter()
                r = simulate(group, load_policy(name), cfg, label)
                wall = time.perf_counter() - t0
                by_group.setdefault(label, {})[name] = r
                if group.name == LONG_TRACE and name in ("spothedge", DEFAULT_POLICY):
                    speed[name] = r.simulated_seconds / wall
                print(json.dumps({
                    "trace": label, "policy": name, "cost_ratio": round(r.cost_ratio, 4),
                    "availability": round(r.availability, 5), "preemptions": r.preemptions,
                    "launches": r.launches, "spot_gpu_hours": round(r.spot_gpu_hours, 1),
                    "on_demand_gpu_hours": round(r.on_demand_gpu_hours, 1),
                }), flush=True)
    ratios = [g[DEFAULT_POLICY].cost / g["spothedge"].cost for g in by_group.values()]
    deltas = [g[DEFAULT_POLICY].availability - g["spothedge"].availability for g in by_group.values()]
    print(json.dumps({
        "summary": True,
        "policy": DEFAULT_POLICY,
        "groups": len(by_group),
        "cost_vs_spothedge": round(sum(ratios) / len(ratios), 4),
        "max_cost_vs_spothedge": round(max(ratios), 4),
        "min_availability_delta": round(min(deltas), 5),
        "dominates_every_group": all(r <= 1 for r in ratios) and all(d >= 0 for d in deltas),
        "replay_sim_s_per_wall_s": {k: round(v) for k, v in speed.items()},
        "replay_trace": LONG_TRACE,
        "settings": {"target": cfg.target, "cold_start_s": cfg.cold_start, "notice_s": cfg.notice,
                     "od_price_ratio": cfg.od_price_ratio,
                     "spothedge": {"num_overprovision": cfg.params.num_overprovision,
                                   "dynamic_ondemand_fallback": cfg.params.dynamic_ondemand_fallback,
                                   "base_ondemand_fallback_replicas": cfg.params.base_ondemand_fallback_replicas}},
        "targets": {"cost_vs_spothedge": "<= 0.90", "min_availability_delta": ">= 0"},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
