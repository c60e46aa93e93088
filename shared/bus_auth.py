"""How services authenticate to NATS and check its servers (credentials, nkeys, user + password, TLS), and
URL redaction for logs. Secrets come from files only and are never logged."""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

_URL_SECRET = re.compile(r"(?P<scheme>[a-z+]+://)(?P<user>[^:@/,]*)(?P<password>:[^@/,]*)?@")


def redact_url(url: str) -> str:
    """`url` (comma-separated URLs too) with any password, or a token (`nats://token@host`), replaced by
    `***`: safe to log."""
    return _URL_SECRET.sub(
        lambda m: f"{m['scheme']}{m['user'] + ':' if m['password'] is not None else ''}***@", url
    )


@dataclass(slots=True, frozen=True)
class NatsAuth:
    """How a service proves itself to NATS and checks the servers: a credentials file, an nkey seed file, or
    user + password file; TLS (server verification, optionally mutual) when a CA or client cert is given.
    Secrets are read from files, never taken from the command line or logged."""

    creds_file: str = ""
    nkey_seed_file: str = ""
    user: str = ""
    password_file: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    @classmethod
    def from_config(cls, config: Any) -> NatsAuth:
        return cls(
            creds_file=config.nats_creds_file,
            nkey_seed_file=config.nats_nkey_seed_file,
            user=config.nats_user,
            password_file=config.nats_password_file,
            tls_ca_file=config.nats_tls_ca_file,
            tls_cert_file=config.nats_tls_cert_file,
            tls_key_file=config.nats_tls_key_file,
        )

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of `nats.connect`; a missing or unreadable file is a ConfigError."""
        options: dict[str, Any] = {}
        if self.creds_file:
            options["user_credentials"] = _readable(self.creds_file, "nats_creds_file")
        if self.nkey_seed_file:
            options["nkeys_seed"] = _readable(self.nkey_seed_file, "nats_nkey_seed_file")
        if self.user:
            options["user"] = self.user
            if self.password_file:
                path = _readable(self.password_file, "nats_password_file")
                options["password"] = Path(path).read_text().strip()
        if self.tls_ca_file or self.tls_cert_file:
            context = ssl.create_default_context(
                cafile=_readable(self.tls_ca_file, "nats_tls_ca_file") if self.tls_ca_file else None
            )
            if self.tls_cert_file:
                context.load_cert_chain(
                    _readable(self.tls_cert_file, "nats_tls_cert_file"),
                    _readable(self.tls_key_file, "nats_tls_key_file") if self.tls_key_file else None,
                )
            options["tls"] = context
        return options


def _readable(path: str, param: str) -> str:
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{param}: cannot read {path}", param=param)
    return path
