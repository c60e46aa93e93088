"""Building blocks: fused linear layers, RMSNorm, SwiGLU MLP and DeepSeek's MoE (routed + shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu.arch_config import ArchConfig
from gpu.linear import Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers computes it: normalize in fp32, cast back, then scale."""
    if x.dtype == torch.float32:  # fewest kernels: this runs twice per layer and step
        return torch.mul(x, torch.mean(x * x, dim=-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class DenseMlp:
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.gate_up = Linear.fused(weights, [prefix + "gate_proj", prefix + "up_proj"])
        self.down = Linear.fused(weights, [prefix + "down_proj"])
        self.inner = self.gate_up.out_features // 2

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
        if prefix + "experts.gate_up_proj" in weights:  # fused layout: [E, 2I, H] and [E, H, I]
            gate_up = list(weights.pop(prefix + "experts.gate_up_proj").unbind(0))
            down = list(weights.pop(prefix + "experts.down_proj").unbind(0))
        else:
            experts = [f"{prefix}experts.{e}." for e in range(self.num_experts)]
            gate_up = [
                torch.cat((weights.pop(p + "gate_proj.weight"), weights.pop(p + "up_proj.weight")))
                for p in experts
            ]
            down = [weights.pop(p + "down_proj.weight") for p in experts]
        self.expert_gate_up = [Linear(w.contiguous(), None) for w in gate_up]
        self.expert_down = [Linear(w.contiguous(), None) for w in down]
        self.inner = down[0].shape[-1]
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
            gate_up = self.expert_gate_up[expert](x_sorted[start:end])
            hidden = F.silu(gate_up[:, : self.inner]) * gate_up[:, self.inner :]
            y[start:end] = self.expert_down[expert](hidden)
            start = end
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_rows, y)
