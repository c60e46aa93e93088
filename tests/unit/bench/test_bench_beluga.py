"""`kvpath bench beluga` without its services: the headline keys come from the parts that ran (ratios the
right way round, None for a part that did not run), both tiers see the same questions, bad options fail."""

from __future__ import annotations

from typing import Any

import pytest

from loadgen.bench.beluga import headline
from loadgen.bench.beluga_serve import ServeOptions, _documents, _Questions


def _out() -> dict[str, Any]:
    rpc = [
        {"transport": "shm", "num_clients": 1, "num_hashes": 1, "p50_us": 5.0},
        {"transport": "shm", "num_clients": 8, "num_hashes": 1, "p50_us": 50.0},
        {"transport": "nats", "num_clients": 1, "num_hashes": 1, "p50_us": 400.0},
    ]
    load = [
        {"source": "memcpy", "block_size": 128, "gbps": 12.0},
        {"source": "pool", "block_size": 128, "gbps": 9.0},
        {"source": "pool-cold", "block_size": 128, "gbps": 6.0},
        {"source": "pool", "block_size": 64, "gbps": 1.0},  # not the headline's block size
        {"source": "remote", "block_size": 128, "gbps": 2.0},
    ]
    serve = [
        {
            "tier": "pool",
            "sweep_kv_load_mean_s": 0.004,
            "sweep_ttft_mean_s": 0.05,
            "sweep_ttft_p99_s": 0.1,
            "peak": {"qps": 20.0},
        },
        {
            "tier": "remote",
            "sweep_kv_load_mean_s": 0.012,
            "sweep_ttft_mean_s": 0.06,
            "sweep_ttft_p99_s": 0.2,
            "peak": {"qps": 16.0},
        },
    ]
    return {
        "rpc": {"results": rpc, "idle_cpu_percent": 0.4},
        "load": {"results": load},
        "serve": {"results": serve},
        "sim": {"sim_ttft_reduction": 0.88, "sim_qps_speedup": 7.4},
    }


def test_headline_from_every_part() -> None:
    h = headline(_out())
    assert h["rpc_rtt_p50_us"] == 5.0 and h["nats_rtt_p50_us"] == 400.0 and h["rpc_speedup"] == 80.0
    assert h["rpc_idle_cpu_percent"] == 0.4
    assert h["pool_load_gbps"] == 9.0 and h["memcpy_gbps"] == 12.0 and h["pool_load_ratio"] == 0.75
    assert h["pool_cold_gbps"] == 6.0 and h["pool_cold_ratio"] == 0.5  # first loads, every block hashed
    assert h["remote_load_gbps"] == 2.0 and h["storage_load_gbps"] is None
    assert h["kv_load_speedup"] == pytest.approx(3.0)  # baseline time / Beluga's
    assert h["ttft_speedup"] == pytest.approx(1.2) and h["ttft_p99_speedup"] == pytest.approx(2.0)
    assert h["qps_speedup"] == pytest.approx(1.25)  # Beluga's QPS / baseline's
    assert (h["sim_ttft_reduction"], h["sim_qps_speedup"]) == (0.88, 7.4)


def test_headline_of_parts_that_did_not_run_is_none() -> None:
    h = headline({"sim": {"sim_ttft_reduction": 0.9, "sim_qps_speedup": 7.0}})
    assert h["sim_qps_speedup"] == 7.0
    assert all(h[k] is None for k in h if not k.startswith("sim_"))


def test_both_tiers_get_the_same_questions() -> None:
    opts = ServeOptions(docs=6, doc_tokens=10, question_tokens=4, zipf=1.2)
    docs = _documents(opts)
    a, b = _Questions(opts, 5), _Questions(opts, 5)
    first = [a.next(docs) for _ in range(50)]
    second = [b.next(docs) for _ in range(50)]
    assert [r.payload for r in first] == [r.payload for r in second]
    assert {r.session_id for r in first} == {r.session_id for r in second}
    assert all(r.prompt_tokens == 14 and r.ideal_cached_tokens == 10 for r in first)
    counts: dict[int, int] = {}
    for r in first:  # Zipf: the hottest document is asked about most
        doc = next(i for i, d in enumerate(docs) if r.payload["prompt"][:10] == d)
        counts[doc] = counts.get(doc, 0) + 1
    assert max(counts.values()) >= 50 // 6 + 5


@pytest.mark.parametrize(
    "bad", [{"docs": 0}, {"clients": 0}, {"rates": (1.0, 0.0)}, {"duration_s": 0}, {"rate_duration_s": -1}]
)
def test_bad_options_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServeOptions(**bad).validate()
