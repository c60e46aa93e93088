"""The bus with credentials and TLS against a real nats-server: user + password file, mutual TLS with a
private CA (certificates made with the openssl CLI), and no secret in any error message."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from shared.bus import Bus
from shared.bus_auth import NatsAuth, redact_url
from shared.errors import ConfigError, ServiceUnavailableError
from shared.natsserver import NatsServer

SECRET = "s3cret-pa55"
# a refused connect is retried (nats-py reconnects) until its deadline, so each one costs exactly this
# long; the server refuses within milliseconds, and any failure raises the same error: a short deadline
# checks the same
REFUSED_S = 0.3


async def _round_trip(bus: Bus) -> None:
    await bus.connect(timeout_s=5.0)
    try:

        async def echo(msg: Msg) -> None:
            await msg.respond(msg.data[::-1])

        sub = await bus.nc.subscribe("t.echo", cb=echo)
        await bus.flush()
        assert (await bus.nc.request("t.echo", b"abc", timeout=2)).data == b"cba"
        await sub.unsubscribe()
    finally:
        await bus.close()


async def test_user_and_password_file(tmp_path: Path) -> None:
    password = tmp_path / "password"
    password.write_text(SECRET + "\n")
    with NatsServer(store_dir=str(tmp_path / "nats"), users={"svc": SECRET}) as server:
        await _round_trip(
            Bus(server.url, "t", name="ok", auth=NatsAuth(user="svc", password_file=str(password)))
        )
        host = server.url.removeprefix("nats://")
        await _round_trip(Bus(f"nats://svc:{SECRET}@{host}", "t", name="inline"))
        wrong = tmp_path / "wrong"
        wrong.write_text("not-it")
        with pytest.raises(ServiceUnavailableError) as refused:
            await Bus(
                server.url, "t", name="bad", auth=NatsAuth(user="svc", password_file=str(wrong))
            ).connect(timeout_s=REFUSED_S)
        assert "not-it" not in refused.value.message
        with pytest.raises(ServiceUnavailableError) as inline:
            bad_inline = Bus(f"nats://svc:wrong-{SECRET}@{host}", "t", name="bad-inline")
            await bad_inline.connect(timeout_s=REFUSED_S)
        assert SECRET not in inline.value.message and "svc:***@" in inline.value.message
        with pytest.raises(ServiceUnavailableError):  # no credentials at all
            await Bus(server.url, "t", name="anonymous").connect(timeout_s=REFUSED_S)
    with pytest.raises(ConfigError, match="nats_password_file"):
        NatsAuth(user="svc", password_file=str(tmp_path / "missing")).connect_options()


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates")
async def test_mutual_tls_with_a_private_ca(tmp_path: Path) -> None:
    d = tmp_path
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days",
             "1", "-subj", "/CN=kvpath-test-ca", cwd=d)  # fmt: skip
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", "san.cnf", cwd=d)  # fmt: skip
    tls = {
        "cert_file": str(d / "server.pem"),
        "key_file": str(d / "server.key"),
        "ca_file": str(d / "ca.pem"),
    }
    with NatsServer(store_dir=str(d / "nats"), tls=tls) as server:
        assert server.url.startswith("tls://")
        auth = NatsAuth(tls_ca_file=str(d / "ca.pem"), tls_cert_file=str(d / "client.pem"),
                        tls_key_file=str(d / "client.key"))  # fmt: skip
        await _round_trip(Bus(server.url, "t", name="mtls", auth=auth))
        with pytest.raises(ServiceUnavailableError):  # the server wants a client certificate
            await Bus(server.url, "t", name="no-cert", auth=NatsAuth(tls_ca_file=str(d / "ca.pem"))).connect(
                timeout_s=REFUSED_S
            )


def test_redact_url() -> None:
    assert redact_url("nats://svc:pw@h:4222") == "nats://svc:***@h:4222"
    assert redact_url("nats://tok3n@h:4222,tls://a:b@g:1") == "nats://***@h:4222,tls://a:***@g:1"
    assert redact_url("nats://h:4222") == "nats://h:4222"
