"""Errors of the model runtime: `ConfigError`s (code "config_error"), so a peer rebuilds them as such."""

from __future__ import annotations

from shared.errors import ConfigError


class UnsupportedModelError(ConfigError):
    """config.json names an architecture, attention variant or RoPE type this runtime does not implement."""


class CheckpointError(ConfigError):
    """A checkpoint is corrupt or does not match its config.json; the message names the tensor or file."""
