"""Linear layers. On the CPU the weight is repacked once into oneDNN's blocked layout, which runs the skinny
matmuls of decode (a handful of rows) and prefill markedly faster than the plain BLAS call; each packed layer
checks itself against F.linear at load and falls back to it if the op is missing or disagrees. The packed
copy replaces the plain weight, so the memory stays the same.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

USE_ONEDNN = True  # tests flip this to compare both paths
_PACK_BATCH_HINT = 8
_PACKABLE = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The oneDNN-packed weight, or None where it is unavailable or does not reproduce F.linear."""
    if not (USE_ONEDNN and weight.device.type == "cpu" and weight.dtype in _PACKABLE and _onednn_available()):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
        want = F.linear(probe, weight, bias)
    except (RuntimeError, AttributeError, TypeError) as exc:
        log.debug("oneDNN linear unavailable (%s); using F.linear", exc)
        return None
    tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2
    scale = float(want.abs().max()) + 1e-6
    if got.shape != want.shape or float((got - want).abs().max()) > tolerance * scale:
        log.warning("oneDNN linear disagrees with F.linear; using F.linear")
        return None
    return packed


class Linear:
    """y = x W^T (+ b); several HF projections reading the same input are concatenated into one matmul."""

    __slots__ = ("bias", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = _pack(weight, bias)
        self.weight: torch.Tensor | None = None if self.packed is not None else weight

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
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)
