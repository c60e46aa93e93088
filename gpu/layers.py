"""Building blocks: fused linear layers, RMSNorm, SwiGLU MLP and DeepSeek's MoE (routed + shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.arch_config import ArchConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it: normalize in fp32, cast back, then scale."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class Linear:
    """y = x W^T (+ b); several HF projections reading the same input are concatenated into one matmul."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    @classmethod
    def fused(cls, weights: dict[str, torch.Tensor], prefixes: list[str]) -> Linear:
        """Pop `<prefix>.weight` (and `.bias` where present) from `weights`, stacked along the output."""
        mats = [weights.pop(p + ".weight") for p in prefixes]
        biases = [weights.pop(p + ".bias", None) for p in prefixes]
        weight = mats[0] if len(mats) == 1 else torch.cat(mats, dim=0)
        if all(b is None for b in biases):
            return cls(weight, None)
        full = [b if b is not None else m.new_zeros(m.shape[0]) for b, m in zip(biases, mats, strict=True)]
        return cls(weight, torch.cat(full))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DenseMlp:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.gate_up = Linear.fused(weights, [prefix + "gate_proj", prefix + "up_proj"])
        self.down = Linear.fused(weights, [prefix + "down_proj"])
        self.inner = self.gate_up.weight.shape[0] // 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        return self.down(F.silu(gate_up[:, : self.inner]) * gate_up[:, self.inner :])


class MoeMlp:
    """DeepSeek-V2 MoE: softmax router, top-k routed experts (greedy or group-limited), shared experts."""

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.top_k, self.num_experts = arch.num_experts_per_tok, arch.n_routed_experts
        self.topk_method, self.n_group, self.topk_group = arch.topk_method, arch.n_group, arch.topk_group
        self.norm_topk_prob, self.scaling = arch.norm_topk_prob, arch.routed_scaling_factor
        self.router = weights.pop(prefix + "gate.weight").float()
        if prefix + "experts.gate_up_proj" in weights:
            self.w_gate_up = weights.pop(prefix + "experts.gate_up_proj")  # [E, 2I, H]
            self.w_down = weights.pop(prefix + "experts.down_proj")  # [E, H, I]
        else:
            experts = [f"{prefix}experts.{e}." for e in range(self.num_experts)]
            self.w_gate_up = torch.stack(
                [
                    torch.cat((weights.pop(p + "gate_proj.weight"), weights.pop(p + "up_proj.weight")))
                    for p in experts
                ]
            )
            self.w_down = torch.stack([weights.pop(p + "down_proj.weight") for p in experts])
        self.inner = self.w_down.shape[-1]
        self.shared = DenseMlp(weights, prefix + "shared_experts.") if arch.n_shared_experts else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scores = F.linear(x.float(), self.router).softmax(dim=-1)
        weights, experts = self._select(scores)
        out = self._routed(x, weights, experts)
        return out if self.shared is None else out + self.shared(x)

    def _select(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.topk_method == "group_limited_greedy":
            grouped = scores.view(scores.shape[0], self.n_group, -1)
            best_groups = grouped.max(dim=-1).values.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best_groups, 1.0).bool()
            scores = scores.masked_fill(~keep[..., None].expand_as(grouped).reshape_as(scores), 0.0)
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = weights * self.scaling
        return weights, experts

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert, one pair of matmuls per expert hit, summed back with index_add."""
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_rows = order // self.top_k
        x_sorted = x[token_rows]
        y = torch.empty_like(x_sorted)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            gate_up = F.linear(x_sorted[start:end], self.w_gate_up[expert])
            hidden = F.silu(gate_up[:, : self.inner]) * gate_up[:, self.inner :]
            y[start:end] = F.linear(hidden, self.w_down[expert])
            start = end
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_rows, y)
