"""Placement policies on every shared spot-trace group: one JSON line per (model, group,
policy), then one summary line comparing the default policy with SpotHedge measured in the
same run, and with the offline optimum.

Settings (SkyServe's evaluation): target 3 READY replicas, 120 s cold start, on-demand = 3x
spot; SpotHedge with num_overprovision=1 and dynamic on-demand fallback (the replica_policy
both policies are given). Models: the replay engine with each cloud's own notice (AWS 120 s,
GCP 30 s), with no notice, with 30 s and with 120 s for every trace; and the SpotHedge
artifact's evaluation model (`--model spothedge-paper`). docs/policies.md explains the keys.

Summary keys: cost_vs_spothedge_* = mean over groups of ours / SpotHedge cost;
min_availability_delta = min over groups and models of ours - SpotHedge availability;
gap_to_optimal = mean over groups of ours / the offline optimum's cost (per-cloud notices);
launches_per_preemption = the default policy's granted launches after its first decision
per replica lost (all groups, per-cloud notices); cost_vs_best_single_cloud = the default
policy on the AWS and GCP CPU traces replayed as one market / SpotHedge on the cheaper of the
two clouds alone (same span and samples), with both availabilities.

Env: BENCH_POLICIES = comma-separated policies for the per-cloud lines (default: every one).
"""

from __future__ import annotations

import json
import os
import sys
import time

from orchestrator.common.paths import traces_dir
from orchestrator.sim.optimum import paper_optimum, replay_optimum
from orchestrator.sim.paper import PaperConfig, simulate_paper
from orchestrator.sim.replay import SimConfig, SimResult, simulate
from orchestrator.sim.traces import cloud_part, labelled_groups, merge_groups
from policies.base import DEFAULT_POLICY, available_policies, load_policy

ANCHOR_TRACE = "aws-02-15-2023"  # the artifact's "2-month" trace
ANCHORS = {"spothedge": 0.456, "round_robin": 0.330, "even_spread": 0.225}  # published paper-model costs
PAIR = ("spothedge", DEFAULT_POLICY)
NOTICES = {"no_notice": 0.0, "notice_30": 30.0, "notice_120": 120.0}
# Two clouds' traces of the same sort (1-node CPU preemption traces, a fortnight apart).
MULTI_CLOUD = ("aws-04-19-2023", "gcp-04-30-2023")


def line(model: str, label: str, r: SimResult) -> None:
    print(json.dumps({
        "model": model, "trace": label, "policy": r.policy, "cost_ratio": round(r.cost_ratio, 4),
        "availability": round(r.availability, 5), "preemptions": r.preemptions, "launches": r.launches,
        "launches_per_preemption": round(r.launches_per_preemption, 3), "notice_s": r.notice_s,
        "spot_gpu_hours": round(r.spot_gpu_hours, 1), "on_demand_gpu_hours": round(r.on_demand_gpu_hours, 1),
    }), flush=True)


def multi_cloud(groups) -> dict:
    """The default policy on two clouds' traces as one market against SpotHedge on the
    cheaper cloud alone; {} when the shared traces lack either."""
    parts = [next((g for _, g in groups if g.folder == folder), None) for folder in MULTI_CLOUD]
    if None in parts:
        return {}
    market = merge_groups(parts, " + ".join(MULTI_CLOUD))
    ours = simulate(market, load_policy(DEFAULT_POLICY), SimConfig())
    line("notice", market.name, ours)
    alone = {}
    for cloud in market.clouds:
        alone[cloud] = simulate(cloud_part(market, cloud), load_policy("spothedge"), SimConfig())
        line("notice", f"{market.name}[{cloud}]", alone[cloud])
    best = min(alone, key=lambda c: alone[c].cost)
    return {
        "cost_vs_best_single_cloud": round(ours.cost / alone[best].cost, 4),
        "multi_cloud_availability": round(ours.availability, 5),
        "best_single_cloud": best,
        "best_single_cloud_spothedge_availability": round(alone[best].availability, 5),
    }


def main() -> int:
    root = traces_dir()
    if not root.is_dir() or not any(root.rglob("*.json")):
        print(json.dumps({"summary": True, "skipped": f"no spot traces at {root} (set SPOT_TRACES_DIR)"}))
        return 0
    names = [n for n in os.environ.get("BENCH_POLICIES", "").split(",") if n] or list(available_policies())
    names += [n for n in PAIR if n not in names]
    groups = labelled_groups([root])
    # runs[model][label][policy]; "notice" is each cloud's own notice length.
    runs: dict[str, dict[str, dict[str, SimResult]]] = {m: {} for m in ("notice", *NOTICES, "paper")}
    speed: dict[str, float] = {}
    for label, group in groups:
        for name in names:
            t0 = time.perf_counter()
            r = simulate(group, load_policy(name), SimConfig(), label)
            if group.folder == ANCHOR_TRACE and name in PAIR:
                speed[name] = r.simulated_seconds / (time.perf_counter() - t0)
            runs["notice"].setdefault(label, {})[name] = r
            line("notice", label, r)
        for model, notice in NOTICES.items():
            for name in PAIR:
                r = simulate(group, load_policy(name), SimConfig(notice=notice), label)
                runs[model].setdefault(label, {})[name] = r
                line(model, label, r)
        paper_names = [*PAIR, *(n for n in ANCHORS if n not in PAIR)] if group.folder == ANCHOR_TRACE else PAIR
        for name in paper_names:
            r = simulate_paper(group, lambda name=name: load_policy(name), PaperConfig(), label)
            runs["paper"].setdefault(label, {})[name] = r
            line("paper", label, r)
    t0 = time.perf_counter()
    optimum = {label: replay_optimum(group, SimConfig(), label) for label, group in groups}
    anchor = next(g for _, g in groups if g.folder == ANCHOR_TRACE)
    paper_opt = paper_optimum(anchor, PaperConfig())
    solve_s = time.perf_counter() - t0
    for label, r in optimum.items():
        line("notice", label, r)
    multi = multi_cloud(groups)

    def cost_ratio(model: str) -> float:
        ratios = [g[DEFAULT_POLICY].cost / g["spothedge"].cost for g in runs[model].values()]
        return round(sum(ratios) / len(ratios), 4)

    def min_delta(model: str) -> float:
        return round(min(g[DEFAULT_POLICY].availability - g["spothedge"].availability
                         for g in runs[model].values()), 5)

    ours = [g[DEFAULT_POLICY] for g in runs["notice"].values()]
    gaps = [runs["notice"][label][DEFAULT_POLICY].cost / opt.cost for label, opt in optimum.items()]
    anchor_label = next(label for label, g in groups if g.folder == ANCHOR_TRACE)
    paper_anchor = runs["paper"][anchor_label]
    deltas = {m: min_delta(m) for m in runs}
    summary = {
        "summary": True,
        "policy": DEFAULT_POLICY,
        "groups": len(groups),
        "cost_vs_spothedge_notice": cost_ratio("notice"),
        "cost_vs_spothedge_no_notice": cost_ratio("no_notice"),
        "cost_vs_spothedge_paper": cost_ratio("paper"),
        "cost_vs_spothedge_notice_30": cost_ratio("notice_30"),
        "cost_vs_spothedge_notice_120": cost_ratio("notice_120"),
        "min_availability_delta": min(deltas.values()),
        "min_availability_delta_by_model": deltas,
        "paper_spothedge_cost_aws_02_15": round(paper_anchor["spothedge"].cost_ratio, 4),
        "paper_spothedge_availability_aws_02_15": round(paper_anchor["spothedge"].availability, 4),
        "paper_baselines_aws_02_15": {n: [round(paper_anchor[n].cost_ratio, 4), round(paper_anchor[n].availability, 4)]
                                      for n in ANCHORS},
        "paper_optimal_cost_aws_02_15": round(paper_opt.cost_ratio, 4),
        "gap_to_optimal": round(sum(gaps) / len(gaps), 4),
        "max_gap_to_optimal": round(max(gaps), 4),
        "launches_per_preemption": round(
            sum(r.launches_per_preemption * r.preemptions for r in ours) / max(1, sum(r.preemptions for r in ours)), 3
        ),
        "max_launches_per_preemption": round(max(r.launches_per_preemption for r in ours), 3),
        **multi,
        "replay_sim_s_per_wall_s": {k: round(v) for k, v in speed.items()},
        "optimum_solve_s": round(solve_s, 1),
        "settings": {"target": 3, "cold_start_s": 120.0, "od_price_ratio": 3.0,
                     "notice_s": "per cloud (AWS 120, GCP 30)",
                     "replica_policy": {"num_overprovision": 1, "dynamic_ondemand_fallback": True}},
        "targets": {
            "cost_vs_spothedge_notice": "<= 0.80", "cost_vs_spothedge_no_notice": "<= 0.95",
            "cost_vs_spothedge_paper": "<= 0.95", "min_availability_delta": ">= 0",
            "paper_spothedge_cost_aws_02_15": f"within 0.03 of {ANCHORS['spothedge']}",
            "gap_to_optimal": "<= 1.15", "launches_per_preemption": "<= 2",
            "cost_vs_best_single_cloud": "< 1.0 at availability >= the single cloud's",
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
