"""The cost model AMPD and `auto` price with when no `kvpath profile` file is given: linear, from what the
services report (pure: a function of the engine table).

New tokens are priced at the engines' measured compute rate (`COMPUTE_RATE`: computed tokens per second of
prefill steps that loaded nothing), not at their prompt rate (`PROMPT_RATE`, loaded + computed tokens per
second, DualPath's unit): at a 95% hit rate a prompt-rate model priced recomputing a 1,900-token context at
~70 ms where it took ~400, so `auto` recomputed long agent contexts instead of reading them. Storage reads
are priced at the fastest storage service's measured read bandwidth; the engines' data link at a fallback.
"""

from __future__ import annotations

import statistics
import time

from services.policy.ampd_costs import STORAGE, CostModel, linear_cost_model
from services.policy.thresholds import FALLBACK_PREFILL_TOKENS_PER_S
from services.router.engines import ROLE_STORAGE, EngineTable
from shared.protocol import COMPUTE_RATE

FALLBACK_LINK_BYTES_PER_S = 1e9  # a link nobody measured (no profile, no storage report)


def measured_cost_model(
    engines: EngineTable, *, data_link: str, roles: tuple[str, ...] | None = None, now: float | None = None
) -> CostModel:
    """T_pre from the median compute rate of the live engines of `roles` (all: None) that report one (else
    `FALLBACK_PREFILL_TOKENS_PER_S`); T_kv over storage from the storage services' best read bandwidth."""
    now = time.monotonic() if now is None else now
    computes = [st.report.rates.get(COMPUTE_RATE, 0.0) for st in engines.live(now, roles=roles)]
    reads = [
        st.report.rates.get("read_bandwidth_bytes_per_s", 0.0)
        for st in engines.live(now, roles=(ROLE_STORAGE,))
    ]
    fmt = engines.kv_format
    return linear_cost_model(
        prefill_tokens_per_s=statistics.median(
            [r for r in computes if r > 0] or [FALLBACK_PREFILL_TOKENS_PER_S]
        ),
        decode_step_s=0.0,
        kv_bytes_per_token=fmt.bytes_per_token if fmt is not None else 1,
        link_bytes_per_s={
            data_link: FALLBACK_LINK_BYTES_PER_S,
            STORAGE: max([r for r in reads if r > 0], default=FALLBACK_LINK_BYTES_PER_S),
        },
    )
