"""Move the query, router side: which primitive serves a request whose prompt starts with a held chunk.

The index names the chunks engines hold (location `held:<engine>`, one bit per holder); a request sent to
engine E whose prompt shares n leading blocks with a chunk that a live engine H != E holds is a candidate.
`HeldRouting.apply` prices route, fetch and local for it with the pure cost model
(`services/policy/movequery.py`: the model's shape and the holder's queue from the engines' load reports,
the fabric constants from a calibrated profile or the uncalibrated fallback) and writes the choice into
the plan as a `HeldPrefix`; the engine does the rest (`services/engine/route.py`). Mode `auto` takes the
argmin; `route`, `fetch` and `local` force one primitive wherever it is possible (benchmarks and tests: the
holder itself is then not picked while another engine can take the request, so every candidate uses it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from services.policy.movequery import (
    CostProfile,
    ModelShape,
    Primitive,
    RouteRequest,
    choose,
    fetch_s,
    local_attention_s,
    local_s,
)
from services.policy.movequery_profile import fallback_profile, profile_from_dict
from services.router import metrics
from services.router.engines import EngineTable
from shared.blocks import max_hit_blocks
from shared.errors import ConfigError
from shared.protocol.movequery import HELD_TIER, HeldPrefix
from shared.protocol.tasks import RequestPlan

log = logging.getLogger(__name__)

MODES = ("", "auto", "route", "fetch", "local")
_SHAPE_RATES = {
    "num_layers": "mq_layers",
    "rows_per_token": "mq_rows_per_token",
    "query_bytes_per_row": "mq_query_bytes_per_row",
    "partial_bytes_per_row": "mq_partial_bytes_per_row",
    "kv_bytes_per_token_layer": "mq_kv_bytes_per_token_layer",
}


def load_profile(path: str) -> CostProfile | None:
    """The calibrated profile file (`kvpath bench movequery --calibrate`); None: none configured."""
    if not path:
        return None
    try:
        return profile_from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read move-the-query profile {path}: {exc}", param="movequery_profile"
        ) from None


class HeldRouting:
    def __init__(self, engines: EngineTable, *, mode: str, profile: CostProfile | None, fabric: str) -> None:
        if mode not in MODES[1:]:
            raise ConfigError(f"move_query mode {mode!r} is not one of {', '.join(MODES[1:])}")
        self.engines = engines
        self.mode = mode
        self.profile = profile
        self.fabric = fabric

    def holders(self, locality: Mapping[str, int]) -> dict[str, int]:
        """Live engines holding a leading chunk of this prompt -> how many blocks of it."""
        out = {}
        for location, n in locality.items():
            tier, _, engine_id = location.partition(":")
            state = self.engines.get(engine_id) if tier == HELD_TIER and n > 0 else None
            if state is not None and state.report.rates.get("mq_route") and not state.report.is_draining:
                out[engine_id] = n
        return out

    def avoid(self, locality: Mapping[str, int]) -> set[str]:
        """Engines not to pick for this request while another can take it (a forced mode: the holders, so
        every candidate uses the forced primitive; `auto` may serve it on the holder itself)."""
        return set(self.holders(locality)) if self.mode != "auto" else set()

    def apply(self, plan: RequestPlan, engine_id: str, locality: Mapping[str, int]) -> None:
        """Set `plan.kv.held` for the engine the request goes to (cleared when nothing is held elsewhere)."""
        plan.kv.held = None
        requester = self.engines.get(engine_id)
        holders = {h: n for h, n in self.holders(locality).items() if h != engine_id}
        if not holders or requester is None or not requester.report.rates.get("mq_route"):
            return
        holder_id, n = max(holders.items(), key=lambda item: item[1])
        block_size = self.engines.kv_format.block_size if self.engines.kv_format else 1
        n = min(n, max_hit_blocks(plan.num_prompt_tokens, block_size))
        if n <= 0:
            return
        holder = self.engines.get(holder_id)
        assert holder is not None
        rates = holder.report.rates
        shape = ModelShape(**{k: int(rates.get(v, 0)) for k, v in _SHAPE_RATES.items()})
        if shape.num_layers <= 0 or shape.rows_per_token <= 0:
            return
        profile = self.profile or fallback_profile(shape)
        num_store = min(n, locality.get("store", 0))
        chunk = n * block_size
        free = requester.snapshot(block_size).free_kv_tokens
        request = RouteRequest(
            chunk_tokens=chunk,
            new_tokens=plan.num_prompt_tokens - chunk,
            decode_steps=plan.sampling.max_tokens,
            free_kv_tokens=free,
            holder_queue_s=float(rates.get("mq_holder_queue_s", 0.0)),
            can_fetch=num_store >= n,
        )
        fabric = profile.fabric(self.fabric)
        primitive = (
            Primitive(self.mode) if self.mode != "auto" else choose(profile, fabric, request).primitive
        )
        if primitive is Primitive.FETCH and num_store < n:
            primitive = Primitive.LOCAL
        take = local_s(profile, chunk)
        if num_store >= n:
            take = min(take, fetch_s(profile, chunk))
        if self.mode != "auto":
            take = 0.0  # a forced primitive is never repriced between decode steps
        plan.kv.held = HeldPrefix(
            holder_id=holder_id,
            num_blocks=n,
            primitive=str(primitive),
            fallback="fetch" if num_store >= n else "local",
            num_store_blocks=num_store,
            take_s=take,
            local_step_s=shape.num_layers * local_attention_s(profile, shape.rows_per_token, chunk),
        )
        if primitive is Primitive.LOCAL:
            plan.kv.num_hit_blocks = 0  # recompute the chunk here
        elif primitive is Primitive.FETCH:
            plan.kv.num_hit_blocks = min(plan.kv.num_hit_blocks, num_store)
        metrics.MOVEQUERY_CHOICES.labels(str(primitive)).inc()
