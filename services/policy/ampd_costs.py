"""AMPD's profiled cost model (brief §2.1, §5.2): piecewise alpha-beta models of prefill, decode, KV moves.

Three cost functions, the ones the paper's profiler fits and its router, reorderer and planner all read:
  T_pre(l_hist, l_incr)   one prefill of `l_incr` new tokens over `l_hist` cached ones, on an engine kind:
                          a_j + b_j * l_incr + c_j * l_incr * (l_hist + l_incr / 2), segment j by l_incr
  T_dec(batch, context)   one decode step: a_j + b_j * batch + c_j * context (the batch's summed context
                          tokens), segment j by batch
  T_kv(tokens, link)      moving the KV of `tokens` over a link (a data-plane transport, storage):
                          0 for no tokens, else a + tokens * kv_bytes_per_token / bytes_per_s
Engine kinds are the engines' roles ("prefill", "decode"): the paper's parallel strategy theta of each phase.

Pure: the file `kvpath profile` writes is read by the caller (router, engine, simulator, planner) and handed
to `CostModel.from_dict`; fitting lives with the profiler (`loadgen/profiler`). Evaluation is a few float
operations (Algorithms 1 and 2 call it per queued task).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.errors import ConfigError

SCHEMA = "kvpath.ampd.profile/1"
ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
STORAGE = "storage"  # the link of a read from the node's block store


@dataclass(frozen=True, slots=True)
class Piecewise:
    """A function linear in its features on each segment: segment j covers [starts[j], starts[j+1]) of the
    segment variable and has one coefficient per feature."""

    starts: tuple[float, ...]
    coefs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.starts or len(self.starts) != len(self.coefs):
            raise ConfigError(f"piecewise model: {len(self.starts)} segment starts, {len(self.coefs)} rows")
        if list(self.starts) != sorted(self.starts):
            raise ConfigError(f"piecewise model: segment starts {self.starts} are not sorted")
        widths = {len(c) for c in self.coefs}
        if len(widths) != 1:
            raise ConfigError(f"piecewise model: rows of different widths {sorted(widths)}")
        if not all(math.isfinite(v) for row in self.coefs for v in row):
            raise ConfigError("piecewise model: a coefficient is not finite")

    def coef(self, x: float) -> tuple[float, ...]:
        return self.coefs[max(0, bisect_right(self.starts, x) - 1)]

    def to_dict(self) -> dict[str, Any]:
        return {"starts": list(self.starts), "coefs": [list(c) for c in self.coefs]}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Piecewise:
        return cls(
            tuple(float(s) for s in obj["starts"]), tuple(tuple(float(v) for v in c) for c in obj["coefs"])
        )


@dataclass(frozen=True, slots=True)
class Link:
    """The Hockney model of one KV link: a fixed cost per move plus bytes over bandwidth."""

    alpha_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.bytes_per_s > 0 and math.isfinite(self.alpha_s)):
            raise ConfigError(f"link model alpha_s={self.alpha_s}, bytes_per_s={self.bytes_per_s}")

    def seconds(self, num_bytes: float) -> float:
        return 0.0 if num_bytes <= 0 else self.alpha_s + num_bytes / self.bytes_per_s


def prefill_features(l_hist: float, l_incr: float) -> tuple[float, float, float]:
    """The features of T_pre: (1, l_incr, l_incr * (l_hist + l_incr / 2)) - fixed, linear, attention."""
    return 1.0, l_incr, l_incr * (l_hist + l_incr / 2)


def decode_features(batch: float, context_tokens: float) -> tuple[float, float, float]:
    return 1.0, batch, context_tokens


@dataclass(frozen=True, slots=True)
class CostModel:
    """T_pre and T_dec per engine kind, T_kv per link; `kv_bytes_per_token` over all layers."""

    kv_bytes_per_token: int
    prefill: Mapping[str, Piecewise]
    decode: Mapping[str, Piecewise]
    links: Mapping[str, Link]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_bytes_per_token <= 0:
            raise ConfigError(f"cost model kv_bytes_per_token={self.kv_bytes_per_token}: must be > 0")
        if not self.prefill or not self.decode:
            raise ConfigError("cost model needs T_pre and T_dec of at least one engine kind")

    def _kind(self, table: Mapping[str, Piecewise], kind: str) -> Piecewise:
        model = table.get(kind)
        return model if model is not None else next(iter(table.values()))

    def prefill_s(self, l_hist: float, l_incr: float, kind: str = ROLE_PREFILL) -> float:
        """T_pre: seconds to prefill `l_incr` tokens over `l_hist` cached ones on an engine of `kind`."""
        if l_incr <= 0:
            return 0.0
        a, b, c = self._kind(self.prefill, kind).coef(l_incr)
        return max(0.0, a + b * l_incr + c * l_incr * (l_hist + l_incr / 2))

    def decode_step_s(self, batch: float, context_tokens: float, kind: str = ROLE_DECODE) -> float:
        """T_dec: seconds of one decode step of `batch` sequences holding `context_tokens` tokens in all."""
        if batch <= 0:
            return 0.0
        a, b, c = self._kind(self.decode, kind).coef(batch)
        return max(0.0, a + b * batch + c * context_tokens)

    def kv_s(self, tokens: float, link: str) -> float:
        """T_kv: seconds to move the KV of `tokens` tokens over `link` (0 for none); an unknown link costs
        as the slowest known one, so a missing measurement never makes a path look free."""
        if tokens <= 0:
            return 0.0
        model = self.links.get(link) or min(self.links.values(), key=lambda m: m.bytes_per_s, default=None)
        if model is None:
            return 0.0
        return model.seconds(tokens * self.kv_bytes_per_token)

    def queue_s(self, work: Sequence[tuple[int, int]], kind: str) -> float:
        """Sum of T_pre over queued (l_hist, l_incr) prefills on an engine of `kind` (Eqs. 1 and 2)."""
        return sum(self.prefill_s(h, i, kind) for h, i in work)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "t_pre": {k: m.to_dict() for k, m in self.prefill.items()},
            "t_dec": {k: m.to_dict() for k, m in self.decode.items()},
            "t_kv": {k: {"alpha_s": m.alpha_s, "bytes_per_s": m.bytes_per_s} for k, m in self.links.items()},
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> CostModel:
        """The model of a profile file's contents; ConfigError naming what is wrong."""
        if not isinstance(obj, Mapping) or obj.get("schema") != SCHEMA:
            raise ConfigError(f"not a kvpath cost profile (schema {SCHEMA!r} expected)", param="cost_profile")
        try:
            return cls(
                kv_bytes_per_token=int(obj["kv_bytes_per_token"]),
                prefill={k: Piecewise.from_dict(v) for k, v in obj["t_pre"].items()},
                decode={k: Piecewise.from_dict(v) for k, v in obj["t_dec"].items()},
                links={k: Link(float(v["alpha_s"]), float(v["bytes_per_s"])) for k, v in obj["t_kv"].items()},
                meta=dict(obj.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"malformed cost profile: {exc!r}", param="cost_profile") from exc


def linear_cost_model(
    *,
    prefill_tokens_per_s: float,
    decode_step_s: float,
    kv_bytes_per_token: int,
    link_bytes_per_s: Mapping[str, float],
    link_alpha_s: float = 1e-4,
) -> CostModel:
    """A one-segment model from rates alone: what a router or engine uses before any profile exists (T_pre
    linear in new tokens, T_dec constant, every link alpha + bytes / bandwidth)."""
    if not (prefill_tokens_per_s > 0 and decode_step_s >= 0):
        raise ConfigError(f"prefill_tokens_per_s={prefill_tokens_per_s}, decode_step_s={decode_step_s}")
    pre = Piecewise((0.0,), ((0.0, 1.0 / prefill_tokens_per_s, 0.0),))
    dec = Piecewise((0.0,), ((decode_step_s, 0.0, 0.0),))
    links = {name: Link(link_alpha_s, bw) for name, bw in link_bytes_per_s.items()}
    return CostModel(
        kv_bytes_per_token=kv_bytes_per_token,
        prefill={ROLE_PREFILL: pre, ROLE_DECODE: pre},
        decode={ROLE_PREFILL: dec, ROLE_DECODE: dec},
        links=links,
        meta={"source": "rates"},
    )
