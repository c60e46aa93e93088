"""Constants of the move-the-query cost model: the paper's, a fallback guess, and a calibrated profile's
plain-dict form (pure: the caller reads and writes the file).

Profile file (JSON, written by `kvpath bench movequery --calibrate`, read by the router's `movequery_profile`
and by the simulator; meant to merge into `kvpath profile` later, so it stays flat and self-describing):

    {"kind": "kvpath.movequery.profile", "version": 1, "model": "tiny", "fingerprint": "...",
     "shape": {"num_layers": 4, "rows_per_token": 8, "query_bytes_per_row": 128, ...},
     "compute": {"local_s_per_token_layer": 2.5e-05, "attention_s_per_row_key": 1e-09, ...},
     "fabrics": {"shm": {"t_probe_s": 0.0003, "bandwidth_bytes_per_s": 2.1e9}, "tcp": {...}},
     "fetch": {"bandwidth_bytes_per_s": 9e8, "fixed_s": 0.002}}
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from services.policy.movequery import Compute, CostProfile, Fabric, ModelShape
from shared.errors import ConfigError

PROFILE_KIND = "kvpath.movequery.profile"
PROFILE_VERSION = 1

# Table 2 of the paper (T_probe, single-block BW): the measured fabrics
PAPER_FABRICS = {
    "ibgda": Fabric("ibgda", 16e-6, 25e9),
    "h100-nvlink4": Fabric("h100-nvlink4", 1.2e-6, 21e9),
    "a100-nvlink3": Fabric("a100-nvlink3", 1.6e-6, 18e9),
    "pcie5": Fabric("pcie5", 4.8e-6, 22e9),
    "pcie4": Fabric("pcie4", 8.7e-6, 19e9),
}
IBGDA_TURNAROUND_S = 9.4e-6  # the residual the 2-constant model omits (brief §3.3, Table 1)
# DeepSeek-V2-Lite in absorbed MLA, bf16 wire: q = 576 x 2, p = 512 x 2 + 2 x 4, b_KV = 576 x 2, L = 27
V2_LITE = ModelShape(
    num_layers=27,
    rows_per_token=16,
    query_bytes_per_row=1152,
    partial_bytes_per_row=1032,
    kv_bytes_per_token_layer=1152,
)
PAPER_SPLICE_S = 3.0e-3  # the flat ~3 ms position adaptation of fetch (2.77-3.06 ms over 55-4096 tokens)
PAPER_C_S = 1.0e-6  # local re-prefill, per token and layer (band 0.5-1.5 us)


def paper_profile(
    *, c_s: float = PAPER_C_S, with_compute: bool = False, pull_fabric: str = "ibgda"
) -> CostProfile:
    """The paper's measured instance. `with_compute` adds the holder partial (~25 us) and merge (<= 25 us)
    its transport fit leaves out; fetch pulls all layers over `pull_fabric`'s rate, then splices."""
    compute = Compute(
        local_s_per_token_layer=c_s,
        attention_s=25e-6 if with_compute else 0.0,
        merge_s_per_row=10e-6 / 256 if with_compute else 0.0,
        splice_s=PAPER_SPLICE_S,
    )
    return CostProfile(
        shape=V2_LITE,
        compute=compute,
        fabrics=dict(PAPER_FABRICS),
        fetch_bandwidth_bytes_per_s=PAPER_FABRICS[pull_fabric].bandwidth_bytes_per_s,
    )


def fallback_profile(shape: ModelShape) -> CostProfile:
    """An uncalibrated guess at CPU scale (this project's engines on a small host), used until a profile is
    measured: ~0.3 ms per data-plane exchange, GB/s-class copies, ~10k prefill tokens/s for the model."""
    compute = Compute(
        local_s_per_token_layer=1e-4 / max(1, shape.num_layers),
        attention_s=5e-5,
        attention_s_per_row_key=2e-9,
        merge_s_per_row=1e-7,
        splice_s_per_byte=2e-10,
    )
    fabrics = {
        "shm": Fabric("shm", 3e-4, 2e9),
        "tcp": Fabric("tcp", 6e-4, 1e9),
        "rdma": Fabric("rdma", 3e-5, 1e10),
    }
    return CostProfile(shape, compute, fabrics, fetch_bandwidth_bytes_per_s=1e9, fetch_fixed_s=3e-3)


def profile_to_dict(profile: CostProfile, **identity: Any) -> dict[str, Any]:
    """The file form; `identity` (model, fingerprint, measured_at, host...) is stored alongside."""
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        **identity,
        "shape": asdict(profile.shape),
        "compute": asdict(profile.compute),
        "fabrics": {name: asdict(f) for name, f in profile.fabrics.items()},
        "fetch": {
            "bandwidth_bytes_per_s": profile.fetch_bandwidth_bytes_per_s,
            "fixed_s": profile.fetch_fixed_s,
        },
    }


def profile_from_dict(data: Any) -> CostProfile:
    """Parse and check the file form; ConfigError naming what is wrong."""
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ConfigError(
            f"not a move-the-query profile (kind {PROFILE_KIND!r} expected)", param="movequery_profile"
        )
    if data.get("version") != PROFILE_VERSION:
        raise ConfigError(f"profile version {data.get('version')!r}, this build reads {PROFILE_VERSION}")
    try:
        fabrics = {
            name: Fabric(**{"name": name, **{k: v for k, v in f.items() if k != "name"}})
            for name, f in data["fabrics"].items()
        }
        fetch = data["fetch"]
        return CostProfile(
            shape=ModelShape(**data["shape"]),
            compute=Compute(**data["compute"]),
            fabrics=fabrics,
            fetch_bandwidth_bytes_per_s=float(fetch["bandwidth_bytes_per_s"]),
            fetch_fixed_s=float(fetch.get("fixed_s", 0.0)),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"malformed move-the-query profile: {exc!r}", param="movequery_profile") from None
