"""`kvpath plan`: AMPD's offline deployment planner (paper §5, Eq. 5; brief §4.5) over the simulator.

Candidates are every (TP, DP) per phase with TP in {1, 2, 4, 8} that fits the model (weights plus some KV in
TP x 96 GB x 0.9) and uses all N GPUs; one whose simulated sessions outgrow a decode replica's KV memory
(brief §7.2) does not fit (tau_dec infinite). Each candidate runs AMPD in the simulator on the trace at the
given load; its coefficients are the P95 TTFT over the TTFT SLO (tau_pre) and the P95 of sessions' mean ITL
over the ITL SLO (tau_dec), normalised so that the two phases compare (brief §4.5, gap 2). The ILP picks one
candidate (binary z_c, sum z_c = 1) minimising Z with Z >= tau_pre(c) z_c and Z >= tau_dec(c) z_c, solved by
`scipy.optimize.milp` (HiGHS); the same argmin by enumeration cross-checks it and gives the top 3, printed
with their simulated SLO attainment.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadgen.sim.ampd.paper import GPU_BYTES, SETUPS, USABLE, VARIANTS, WEIGHT_BYTES, Deployment, run
from services.policy.ampd_slo import session_itl

TP_DEGREES = (1, 2, 4, 8)
MIN_KV_BYTES = 10e9  # a replica must hold some KV besides the weights


@dataclass(slots=True)
class Candidate:
    deployment: Deployment
    tau_pre: float
    tau_dec: float
    attainment: float

    @property
    def z(self) -> float:
        return max(self.tau_pre, self.tau_dec)


def candidates(gpus: int) -> list[Deployment]:
    fits = [tp for tp in TP_DEGREES if tp * GPU_BYTES * USABLE >= WEIGHT_BYTES + MIN_KV_BYTES]
    out = []
    for tp_p in fits:
        for tp_d in fits:
            for dp_p in range(1, gpus // tp_p + 1):
                rest = gpus - tp_p * dp_p
                if rest > 0 and rest % tp_d == 0:
                    out.append(Deployment(tp_p, dp_p, tp_d, rest // tp_d))
    return out


def evaluate(trace: str, dep: Deployment, *, n: int, load: float, seed: int) -> Candidate:
    setup = SETUPS[trace]
    done, counts = run(trace, VARIANTS["ampd"], n=n, load=load, seed=seed, deployment=dep)
    ttfts = [t for s in done for t in s.ttfts]
    itls = [session_itl(s.latencies()) for s in done if s.itl_tokens]  # the SLO's ITL statistic
    p95_ttft = float(np.percentile(ttfts, 95)) if ttfts else float("inf")
    p95_itl = float(np.percentile(itls, 95)) if itls else 0.0
    attainment = sum(s.meets_slo() for s in done) / len(done)
    # sessions' KV outgrew a decode replica (brief §7.2; the paper has no eviction): it does not fit memory
    tau_dec = float("inf") if counts.over_capacity else p95_itl / setup.itl_slo_s
    return Candidate(dep, p95_ttft / setup.ttft_slo_s, tau_dec, attainment)


def solve(cands: list[Candidate]) -> int:
    """Eq. 5 as a MILP over one binary per candidate (and Z): the index of the chosen candidate."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    k = len(cands)
    tau = np.array([[c.tau_pre, c.tau_dec] for c in cands])
    tau = np.where(np.isfinite(tau), tau, 1e9)
    c = np.zeros(k + 1)
    c[-1] = 1.0  # minimise Z
    rows = [np.append(np.ones(k), 0.0)]  # sum z = 1
    lo, hi = [1.0], [1.0]
    for j in range(k):
        for phase in (0, 1):  # Z - tau_j z_j >= 0
            row = np.zeros(k + 1)
            row[j], row[-1] = -tau[j, phase], 1.0
            rows.append(row)
            lo.append(0.0)
            hi.append(np.inf)
    integrality = np.append(np.ones(k), 0)
    bounds = Bounds(np.zeros(k + 1), np.append(np.ones(k), np.inf))
    result = milp(
        c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality, bounds=bounds
    )
    if not result.success:
        raise RuntimeError(f"MILP failed: {result.message}")
    return int(np.argmax(result.x[:k]))


def plan(trace: str, gpus: int, *, n: int, load: float, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    cands = [evaluate(trace, dep, n=n, load=load, seed=seed) for dep in candidates(gpus)]
    chosen = solve(cands)
    ranked = sorted(range(len(cands)), key=lambda i: (cands[i].z, i))
    if cands[chosen].z != cands[ranked[0]].z:
        raise RuntimeError("MILP and enumeration disagree")
    return {
        "trace": trace,
        "gpus": gpus,
        "chosen": _row(cands[chosen]),
        "top": [_row(cands[i]) for i in ranked[:3]],
        "candidates": len(cands),
        "plan_s": time.perf_counter() - started,
    }


def _row(c: Candidate) -> dict[str, Any]:
    return {**asdict(c.deployment), "tau_pre": c.tau_pre, "tau_dec": c.tau_dec, "attainment": c.attainment}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="AMPD's deployment planner (ILP over simulated candidates)")
    p.add_argument("--trace", default="hotpotqa", choices=sorted(SETUPS))
    p.add_argument("--gpus", type=int, default=0, help="GPU budget (default: the trace's paper cluster)")
    p.add_argument("--sessions", type=int, default=80)
    p.add_argument("--load", type=float, default=0.45, help="share of the cluster's prefill throughput")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    gpus = args.gpus or SETUPS[args.trace].gpus
    out = plan(args.trace, gpus, n=args.sessions, load=args.load, seed=args.seed)
    print(f"{args.trace} on {gpus} GPUs: {out['candidates']} candidates in {out['plan_s']:.1f} s")
    for rank, row in enumerate(out["top"], 1):
        print(
            f"#{rank} P<TP={row['tp_prefill']},DP={row['dp_prefill']}> D<TP={row['tp_decode']},"
            f"DP={row['dp_decode']}>  tau_pre {row['tau_pre']:.2f}  tau_dec {row['tau_dec']:.2f}  "
            f"SLO attainment {row['attainment']:.0%}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
