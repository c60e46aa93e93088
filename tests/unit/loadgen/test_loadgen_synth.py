"""Synthesized traces reproduce the published workload means (DualPath Table 2, AMPD Table 1) within 5%."""

from __future__ import annotations

import numpy as np
import pytest

from loadgen.profiles import PROFILES, SynthOptions, synthesize
from loadgen.stats import trace_stats

TOLERANCE = 0.05


@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_matches_published_means(name: str, seed: int) -> None:
    profile = PROFILES[name]
    stats = trace_stats(synthesize(profile, SynthOptions(agents=500, seed=seed)))
    for key, published in profile.published.items():
        assert stats[key] == pytest.approx(published, rel=TOLERANCE), (name, key, stats[key], published)


def test_dualpath_tables_all_five_columns() -> None:
    # Table 2 quotes turns, append, gen, total and context for each MaxLen; each profile checks all five
    for name, maxlen in (("dualpath-32k", 32768), ("dualpath-48k", 49152), ("dualpath-64k", 65536)):
        profile = PROFILES[name]
        assert set(profile.published) == {"turns", "append", "gen", "total", "context"}
        trace = synthesize(profile, SynthOptions(agents=200, seed=1))
        assert max(t.total_tokens() for t in trace.trajectories) <= maxlen


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = synthesize(PROFILES["toolbench"], SynthOptions(agents=30, seed=5))
    b = synthesize(PROFILES["toolbench"], SynthOptions(agents=30, seed=5))
    c = synthesize(PROFILES["toolbench"], SynthOptions(agents=30, seed=6))
    assert a.trajectories == b.trajectories and a.trajectories != c.trajectories


def test_agents_are_distinct() -> None:
    trace = synthesize(PROFILES["dualpath-32k"], SynthOptions(agents=50, seed=2))
    assert len({t.seed for t in trace.trajectories}) == 50
    assert len({t.agent_id for t in trace.trajectories}) == 50


def test_base_trajectories_get_a_random_first_round() -> None:
    opts = SynthOptions(agents=12, seed=3, base_trajectories=2, first_round_tokens=32)
    trace = synthesize(PROFILES["hotpotqa"], opts)
    for t in trace.trajectories:
        assert (t.rounds[0].append_tokens, t.rounds[0].gen_tokens, t.rounds[0].seed) == (32, 1, None)
        assert len(t.rounds) == 4  # the prepended round plus HotpotQA's three
    shared = {tuple(r.seed for r in t.rounds[1:]) for t in trace.trajectories}
    assert len(shared) == 2  # agents replay one of two base trajectories' content
    assert len({t.seed for t in trace.trajectories}) == 12


def test_length_scale_and_max_context() -> None:
    full = synthesize(PROFILES["dualpath-32k"], SynthOptions(agents=40, seed=4))
    small = synthesize(PROFILES["dualpath-32k"], SynthOptions(agents=40, seed=4, length_scale=0.1))
    ratio = trace_stats(small)["total"] / trace_stats(full)["total"]
    assert ratio == pytest.approx(0.1, rel=0.05)
    capped = synthesize(
        PROFILES["dualpath-32k"], SynthOptions(agents=40, seed=4, length_scale=0.1, max_context=1000)
    )
    assert all(t.total_tokens() <= 1000 for t in capped.trajectories)
    assert trace_stats(capped)["turns"] < trace_stats(small)["turns"]  # trajectories end at the limit


def test_tool_latency_means() -> None:
    for name, mean_s in (("gaia", 1.0), ("dureader", 0.2), ("dualpath-48k", 0.0)):
        trace = synthesize(PROFILES[name], SynthOptions(agents=300, seed=8))
        waits = [r.tool_latency_s for t in trace.trajectories for r in t.rounds[:-1]]
        assert all(t.rounds[-1].tool_latency_s == 0 for t in trace.trajectories)
        assert float(np.mean(waits)) == pytest.approx(mean_s, rel=0.1, abs=1e-9)
    none = synthesize(PROFILES["gaia"], SynthOptions(agents=5, seed=8, tool_scale=0.0))
    assert all(r.tool_latency_s == 0 for t in none.trajectories for r in t.rounds)


def test_invalid_agent_count() -> None:
    with pytest.raises(ValueError, match="agents must be >= 1"):
        synthesize(PROFILES["gaia"], SynthOptions(agents=0))
