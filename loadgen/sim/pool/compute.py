"""Seconds of one continuous-batching step of Qwen-32B on one H20 (a GAP of the paper, brief 7.4).

A step computes prefill chunks and one decode token per running sequence. Its time is a fixed overhead, the
larger of the linear layers' FLOPs and one read of the weights, plus the prefill attention FLOPs (the
house's `attention_flops`, per layer) and the decode attention's KV reads from HBM. The one calibrated number
is the effective FLOP/s: set so the cache-populate run's mean TTFT sits in the paper's 17-20 s (Table 5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from loadgen.sim.pool.costs import GB
from services.policy.batching import AttentionShape, attention_flops


@dataclass(frozen=True, slots=True)
class StepModel:
    num_layers: int = 64  # (P) 4.2
    kv_bytes_per_token: int = 262144  # (I) KvGeometry's
    active_params: float = 32.8e9  # (I) Qwen3-32B
    attention_shape: AttentionShape = field(default_factory=lambda: AttentionShape(64, 128))  # (I) Qwen3
    weight_bytes: float = 60.0 * GB  # (P) "the model occupies 60.0 GB" (7.1)
    hbm_bytes_per_s: float = 4.0e12  # (I) H20 HBM3 spec
    flops_per_s: float = 105e12  # (I, calibrated) effective bf16 FLOP/s (H20 peak 148)
    overhead_s: float = 0.005  # (I) scheduler, sampling, launches per step

    def step_s(self, prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """`prefill`: (cached tokens, new tokens) per prefilling sequence; `decode_contexts`: the context of
        each decoding sequence. An empty step costs nothing."""
        new_tokens = sum(n for _, n in prefill) + len(decode_contexts)
        if new_tokens == 0:
            return 0.0
        linear_s = 2.0 * self.active_params * new_tokens / self.flops_per_s
        weights_s = self.weight_bytes / self.hbm_bytes_per_s
        attention = sum(attention_flops(c, n, self.attention_shape) for c, n in prefill) * self.num_layers
        kv_read_s = sum(decode_contexts) * self.kv_bytes_per_token / self.hbm_bytes_per_s
        return self.overhead_s + max(linear_s, weights_s) + attention / self.flops_per_s + kv_read_s
