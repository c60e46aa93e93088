"""`kvpath up --policy auto --prefill-nodes N --decode-nodes M --auto-decode-engines session|dualpath`: the
decode engines it starts (session engines, or DualPath's, started as `--policy dualpath` starts them) and the
router told which they are."""

from __future__ import annotations

import argparse

import pytest

from services.router.auto_pd import PD_PATHS
from services.router.config import RouterConfig
from services.up.topology import AUTO_DECODE_ENGINES, ProcessSpec
from shared.config import add_config_args, config_from_args
from tests.unit.test_up_topology import _spec

PD = ("--prefill-nodes", "1", "--decode-nodes", "2")


def engine_args(procs: list[ProcessSpec]) -> dict[str, list[str]]:
    return {p.name: p.args for p in procs if p.service == "engine"}


def router_config(procs: list[ProcessSpec]) -> RouterConfig:
    """The router's config, parsed from the flags `kvpath up` gives it, as `kvpath serve router` does."""
    (router,) = [p for p in procs if p.service == "router"]
    parser = argparse.ArgumentParser()
    add_config_args(parser, RouterConfig)
    config = config_from_args(RouterConfig, parser.parse_args(router.args), section="router")
    config.validate()
    return config


def test_dualpath_decode_engines_start_as_dualpath_starts_them_and_the_router_knows() -> None:
    procs, policy = _spec("--policy", "auto", *PD, "--auto-decode-engines", "dualpath")
    dualpath, _ = _spec("--policy", "dualpath", *PD)
    assert policy == "auto" and engine_args(procs) == engine_args(dualpath)
    assert all("--session-kv" not in args for args in engine_args(procs).values())
    config = router_config(procs)
    assert (config.policy, config.auto_decode_engines) == ("auto", "dualpath")


def test_session_decode_engines_stay_the_default() -> None:
    procs, _ = _spec("--policy", "auto", *PD)
    decode = [args for args in engine_args(procs).values() if "decode" in args]
    assert len(decode) == 2 and all("--session-kv" in args for args in decode)
    assert router_config(procs).auto_decode_engines == "session"
    colocated, _ = _spec("--policy", "auto", "--engines", "2")
    assert "--auto-decode-engines" not in next(p for p in colocated if p.service == "router").args


@pytest.mark.parametrize("argv", [("--policy", "dualpath", *PD), ("--policy", "auto", "--engines", "2")])
def test_the_decode_engines_of_auto_need_auto_on_prefill_decode_nodes(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match="--auto-decode-engines is for --policy auto"):
        _spec(*argv, "--auto-decode-engines", "dualpath")


def test_up_offers_what_the_router_runs() -> None:
    assert set(AUTO_DECODE_ENGINES) == set(PD_PATHS)
