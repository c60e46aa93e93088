"""Closed-form checks from the DualPath brief: bottleneck-free P/D range (section 4), cache-compute ratio
(1.3, Table 1), expected per-link traffic (Eqs. 1-8) and the working-set estimate (7.9). Pure functions."""

from __future__ import annotations

from dataclasses import dataclass

from loadgen.sim.models import SimModel
from shared.errors import ConfigError

TABLE1_APPEND_TOKENS = 429


def bottleneck_free_range(
    g: int = 8, s: float = 1.0, b: float = 50.0, m: float = 500.0
) -> tuple[float, float]:
    """Eq. 9: the P/D ratios for which no CNIC direction or DRAM saturates before the SNICs.

    `g` GPUs (CNICs of bandwidth `b`) per node, storage bandwidth `s * b` per node, DRAM bandwidth `m`.
    """
    if not (g > 2 * s > 0 and b > 0 and m > 3 * b * s):
        raise ConfigError(f"bottleneck_free_range(g={g}, s={s}, b={b}, m={m}): need g > 2s > 0 and m > 3bs")
    low = s / (g - s)
    high = min((g - 2 * s) / s, (g - s) / (2 * s), (m / (b * s) - 3) / 2)
    return low, high


def cache_compute_ratio(
    model: SimModel, context_tokens: int, append_tokens: int = TABLE1_APPEND_TOKENS
) -> float:
    """GB of KV to load per PFLOP of prefill of one turn (Table 1): context KV / (append x FLOPs/token)."""
    kv_gb = context_tokens * model.kv_bytes_per_token / 1e9
    flops_per_token = 2 * model.active_params + model.attention_flops_per_query(context_tokens)
    return kv_gb / (append_tokens * flops_per_token / 1e15)


@dataclass(frozen=True, slots=True)
class LinkRates:
    """Bytes/s per link instance, as Eqs. 1-8 count them (CNIC directions are the PCIe side)."""

    pe_cnic_read: float
    pe_cnic_write: float
    de_cnic_read: float
    de_cnic_write: float
    pe_dram: float
    de_dram: float


def expected_link_rates(
    num_prefill_nodes: int,
    num_decode_nodes: int,
    g: int,
    pe_path_bytes_per_s: float,
    de_path_bytes_per_s: float,
) -> LinkRates:
    """Per-link rates implied by the hit-KV read rates of each path (all PE-node SNICs together, all DE-node
    SNICs together), under the analysis' load balance; the small miss-KV flows are left out as in the paper.

    With every SNIC saturated, pe_path = P*s*B and de_path = D*s*B and this is Eqs. 1, 2, 4, 6 and 8.
    """
    num_pes, num_des = num_prefill_nodes * g, num_decode_nodes * g
    pe_path, de_path = pe_path_bytes_per_s, de_path_bytes_per_s
    return LinkRates(
        pe_cnic_read=2 * pe_path / num_pes,  # steps 3 and 5 of the PE path
        pe_cnic_write=(pe_path + de_path) / num_pes,  # PE path step 4, DE path step 5
        de_cnic_read=(pe_path + 2 * de_path) / num_des,  # PE path step 8, DE path steps 3 and 6
        de_cnic_write=(2 * pe_path + de_path) / num_des,  # PE path steps 7 and 9, DE path step 7
        pe_dram=2 * pe_path / num_prefill_nodes,  # storage -> buffer, buffer -> HBM
        de_dram=(3 * de_path + 2 * pe_path) / num_decode_nodes,
    )


def working_set_tokens(agents_per_s: float, mean_jct_s: float, mean_total_tokens: float) -> float:
    """Section 8.2 of the paper: about lambda * T * total_len / 2 tokens of KV are live at once."""
    return agents_per_s * mean_jct_s * mean_total_tokens / 2
