"""Config precedence (default < YAML < env < CLI) and validation errors that name the field."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from shared.config import BaseConfig, add_config_args, build_config, config_from_args
from shared.errors import ConfigError


def test_precedence(tmp_path: Path) -> None:
    path = tmp_path / "kvpath.yaml"
    path.write_text("common:\n  node: 2\n  namespace: fromyaml\nrouter:\n  http_port: 8100\n")
    env = {"KVPATH_HTTP_PORT": "8200", "KVPATH_LOG_JSON": "true"}
    cfg = build_config(BaseConfig, section="router", yaml_path=path, env=env, overrides={"node": "3"})
    assert (cfg.namespace, cfg.http_port, cfg.node, cfg.log_json) == ("fromyaml", 8200, 3, True)


def test_cli_flags_round_trip() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_config_args(parser, BaseConfig)
    args = parser.parse_args(["--http-port", "9000", "--log-json"])
    cfg = config_from_args(BaseConfig, args, section="x")
    assert cfg.http_port == 9000 and cfg.log_json is True and cfg.node == 0


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"KVPATH_NODE": "abc"}, "KVPATH_NODE='abc': expected int"),
        ({"KVPATH_NODE": "-1"}, "node=-1"),
        ({"KVPATH_LOG_JSON": "maybe"}, "expected bool"),
        ({"KVPATH_HEARTBEAT_INTERVAL_S": "4"}, "registry_ttl_s"),
    ],
)
def test_validation_errors(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(BaseConfig, section="x", env=env)
    assert fragment in err.value.message


def test_unknown_yaml_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("router:\n  no_such_key: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key router\.no_such_key"):
        build_config(BaseConfig, section="router", yaml_path=path, env={})
