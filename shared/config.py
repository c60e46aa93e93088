"""Typed configuration: one dataclass per service, loaded from YAML, `KVPATH_*` environment and CLI flags.

Precedence (lowest first): field default < YAML (`common:` section, then the service's section) <
environment `KVPATH_<FIELD>` < CLI flag `--field-name`. Every field has a default and a one-line doc in its
metadata; `validate()` does the cross-field checks and raises `ConfigError` naming the offending values.
Services build their config once in `__main__` and pass it down.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from shared.errors import ConfigError

ENV_PREFIX = "KVPATH_"
DEFAULT_BLOCK_SIZE = 64

C = TypeVar("C", bound="BaseConfig")


def doc(default: Any, text: str) -> Any:
    """A field with a default and its one-line documentation."""
    if isinstance(default, list | dict):
        factory = default.copy
        return field(default_factory=factory, metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(slots=True)
class BaseConfig:
    """Fields every service shares: the bus, its identity and its lifecycle."""

    nats_url: str = doc("nats://127.0.0.1:4222", "NATS server URL (comma-separated for a cluster)")
    jetstream_replicas: int = doc(
        1, "replicas of the JetStream stream and bucket a service creates (3 on a 3-node NATS cluster)"
    )
    nats_creds_file: str = doc("", "NATS credentials file (JWT + nkey seed, as `nsc` writes it)")
    nats_nkey_seed_file: str = doc("", "file holding this service's NATS nkey seed")
    nats_user: str = doc("", "NATS user name (the password comes from nats_password_file)")
    nats_password_file: str = doc("", "file holding the NATS password of nats_user")
    nats_tls_ca_file: str = doc("", "CA bundle to verify the NATS servers' certificates (turns TLS on)")
    nats_tls_cert_file: str = doc("", "client certificate for NATS mutual TLS (with nats_tls_key_file)")
    nats_tls_key_file: str = doc("", "private key of nats_tls_cert_file")
    namespace: str = doc("default", "bus namespace: every subject lives under kvpath.<namespace>.")
    service_id: str = doc("", "unique id of this service instance; generated when empty")
    node: int = doc(0, "node number: engines of one node share its DRAM buffer and storage service")
    http_host: str = doc("127.0.0.1", "bind address of the service's HTTP endpoint (health, metrics)")
    http_port: int = doc(0, "port of the service's HTTP endpoint; 0 picks a free one")
    http_backlog: int = doc(1024, "listen backlog of the HTTP endpoint (many clients connecting at once)")
    advertise_host: str = doc(
        "",
        "host name peers use to reach this service; default: http_host, or this "
        "machine's name when http_host is 0.0.0.0",
    )
    load_report_interval_s: float = doc(0.1, "period of load reports on the bus")
    heartbeat_interval_s: float = doc(1.0, "period of registry heartbeats")
    registry_ttl_s: float = doc(5.0, "a service missing heartbeats this long is considered gone")
    drain_timeout_s: float = doc(10.0, "on SIGTERM, finish in-flight work for at most this long")
    request_timeout_s: float = doc(5.0, "deadline of a bus request/reply round trip")
    log_level: str = doc("INFO", "logging level")
    log_json: bool = doc(False, "write logs as JSON lines")

    def validate(self) -> None:
        _check(
            self.namespace.replace("-", "").replace("_", "").isalnum(),
            "namespace",
            self.namespace,
            "letters, digits, '-' and '_' only",
        )
        _check(self.node >= 0, "node", self.node, "must be >= 0")
        _check(1 <= self.jetstream_replicas <= 5, "jetstream_replicas", self.jetstream_replicas, "1 to 5")
        _check(0 <= self.http_port < 65536, "http_port", self.http_port, "must be a port number")
        for name in (
            "load_report_interval_s",
            "heartbeat_interval_s",
            "registry_ttl_s",
            "drain_timeout_s",
            "request_timeout_s",
        ):
            _check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")
        _check(
            self.registry_ttl_s > 2 * self.heartbeat_interval_s,
            "registry_ttl_s",
            self.registry_ttl_s,
            f"must exceed twice heartbeat_interval_s={self.heartbeat_interval_s}",
        )
        _check(
            self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
            "log_level",
            self.log_level,
            "one of DEBUG, INFO, WARNING, ERROR",
        )


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config {name}={value!r}: {why}", param=name)


def check(ok: bool, name: str, value: Any, why: str) -> None:
    """Raise `ConfigError` naming field `name` and its `value` unless `ok`."""
    _check(ok, name, value, why)


# --------------------------------------------------------------------------------------------- loading


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(name: str, raw: Any, typ: Any) -> Any:
    """Convert a YAML/env/CLI value to the field's declared type, or raise a ConfigError."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, raw, inner[0])
    if origin is list:
        if isinstance(raw, str):
            raw = [p for p in raw.split(",") if p.strip()]
        if not isinstance(raw, list):
            raise ConfigError(f"invalid config {name}={raw!r}: expected a list", param=name)
        return [_coerce(name, item, args[0] if args else str) for item in raw]
    try:
        if typ is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if typ is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(float(raw)) if isinstance(raw, str) and "e" in raw.lower() else int(raw)
        if typ is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        if typ is str:
            if not isinstance(raw, str | int | float):
                raise ValueError(raw)
            return str(raw)
    except (TypeError, ValueError):
        tname = getattr(typ, "__name__", str(typ))
        raise ConfigError(f"invalid config {name}={raw!r}: expected {tname}", param=name) from None
    return raw


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def build_config(
    cls: type[C],
    *,
    section: str,
    yaml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> C:
    """Build and validate `cls` from defaults, YAML, environment and explicit overrides (CLI flags)."""
    env = os.environ if env is None else env
    hints = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if yaml_path:
        data = load_yaml(yaml_path)
        for part in ("common", section):
            block = data.get(part) or {}
            if not isinstance(block, dict):
                raise ConfigError(f"config file {yaml_path}: section {part!r} must be a mapping")
            for key, raw in block.items():
                key = key.replace("-", "_")
                if key in names:
                    values[key] = _coerce(f"{part}.{key}", raw, hints[key])
                elif part == section:
                    raise ConfigError(f"config file {yaml_path}: unknown key {section}.{key}", param=key)
    for name in names:
        env_key = ENV_PREFIX + name.upper()
        if env_key in env:
            values[name] = _coerce(env_key, env[env_key], hints[name])
    for name, raw in (overrides or {}).items():
        if raw is None:
            continue
        if name not in names:
            raise ConfigError(f"unknown config field {name!r} for {section}", param=name)
        values[name] = _coerce(name, raw, hints[name])
    config = cls(**values)
    config.validate()
    return config


def add_config_args(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one `--field-name` flag per config field; unset flags stay None and do not override."""
    hints = _field_types(cls)
    group = parser.add_argument_group(f"{cls.__name__} (also KVPATH_<FIELD> env and YAML)")
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('doc', '')} (default: {_default_of(f)!r})"
        if hints[f.name] is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            group.add_argument(flag, dest=f.name, default=None, help=help_text)


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def config_from_args(cls: type[C], args: argparse.Namespace, *, section: str) -> C:
    """Build `cls` from a parsed namespace produced by a parser that has `add_config_args` and `--config`."""
    names = {f.name for f in dataclasses.fields(cls)}
    overrides = {k: v for k, v in vars(args).items() if k in names}
    return build_config(cls, section=section, yaml_path=getattr(args, "config", None), overrides=overrides)


def as_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
