"""Who may publish what, enforced by a real nats-server run with the generated config;
TLS to NATS and to Redis with a certificate made here."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import subprocess
import time
from pathlib import Path

import nats
import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from events import encode
from events import subjects as s
from events.models import ChatCompleted, ChatRequested
from infra import nats_auth
from infra.servers import redis_server_binary, start_nats, wait_port
from infra.supervisor import create_topology, with_credentials
from runtime import jetstream
from runtime.net import free_port
from runtime.redis import redis_client
from runtime.settings import CommonSettings
from tests.arena_up import arena, user_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

REFUSED = (NatsTimeout, NoRespondersError, asyncio.TimeoutError)


class Secured:
    def __init__(self, tmp: Path):
        self.passwords = nats_auth.new_passwords()
        config = tmp / "nats.conf"
        config.write_text(nats_auth.server_config(self.passwords))
        self.log = tmp / "nats.log"
        self.server = start_nats(tmp / "store", config=config, log_file=self.log)
        self.url = self.server.url

    def url_of(self, user: str) -> str:
        return with_credentials(self.url, user, self.passwords[user])

    async def connect(self, user: str) -> tuple[nats.NATS, list[str]]:
        """A connection as `user` and the errors the server sent it (permission violations)."""
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            self.url, user=user, password=self.passwords[user], error_cb=on_error, allow_reconnect=False
        )
        return nc, errors


@pytest.fixture
def secured(tmp_path):
    """nats-server with one user per role (auth is opt-in: the default fixtures take any connection)."""
    srv = Secured(tmp_path)
    asyncio.run(create_topology(srv.url_of(nats_auth.OPERATOR)))
    yield srv
    srv.server.stop()


def completed(request_id: str) -> ChatCompleted:
    return ChatCompleted(
        request_id=request_id,
        conv_id="c1",
        turn_id=0,
        model="stories-260k",
        text="forged",
        finish_reason="stop",
        usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        timings={"queue_wait_s": 0.0, "ttft_s": 0.0, "decode_s": 0.0, "compute_s": 0.0},
        chunks=0,
    )


def requested(request_id: str) -> ChatRequested:
    return ChatRequested(
        request_id=request_id,
        conv_id="c1",
        turn_id=0,
        model="stories-260k",
        messages=[{"role": "user", "content": "hi"}],
        params={},
        deadline_at=time.time() + 15,
    )


async def stored(srv: Secured, subject: str) -> int:
    nc, _ = await srv.connect(nats_auth.OPERATOR)
    try:
        info = await nc.jetstream().stream_info(s.STREAM, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def test_the_gateway_cannot_forge_a_terminal_event(secured):
    nc, errors = await secured.connect("gateway")
    js = nc.jetstream(timeout=1.0)
    event = completed("forged1")
    try:
        with pytest.raises(REFUSED):
            await js.publish(s.subject_for(event), encode(event), headers={"Nats-Msg-Id": event.dedupe_key()})
        await asyncio.sleep(0.2)
        # What the gateway may publish goes through on the same connection.
        ok = await js.publish(
            s.subject_for(req := requested("r1")),
            encode(req),
        )
        assert ok.stream == s.STREAM
    finally:
        await nc.close()
    assert any("permissions violation" in e.lower() for e in errors), errors
    assert await stored(secured, f"{s.COMPLETED}.>") == 0


async def test_inference_may_publish_it(secured):
    nc, errors = await secured.connect("inference")
    try:
        event = completed("real1")
        ack = await nc.jetstream(timeout=2.0).publish(s.subject_for(event), encode(event))
        assert ack.stream == s.STREAM and not errors
    finally:
        await nc.close()
    assert await stored(secured, f"{s.COMPLETED}.>") == 1


async def test_a_role_cannot_change_the_stream(secured):
    nc, _ = await secured.connect("gateway")
    js = nc.jetstream(timeout=1.0)
    try:
        config = (await js.stream_info(s.STREAM)).config
        config.subjects = [*config.subjects, "arena.live.>"]
        with pytest.raises(REFUSED):
            await js.update_stream(config)
        with pytest.raises(REFUSED):
            await js.delete_consumer(s.STREAM, "inference")
    finally:
        await nc.close()
    operator, _ = await secured.connect(nats_auth.OPERATOR)
    try:
        js = operator.jetstream()
        assert "arena.live.>" not in (await js.stream_info(s.STREAM)).config.subjects
        assert (await js.consumer_info(s.STREAM, "inference")).name == "inference"
    finally:
        await operator.close()


async def test_unauthenticated_and_wrong_password_connections_are_refused(secured):
    for kwargs in ({}, {"user": "gateway", "password": "wrong"}):
        with pytest.raises(Exception, match=r"(?i)authorization"):
            await nats.connect(secured.url, allow_reconnect=False, connect_timeout=2, **kwargs)


async def test_a_process_connects_with_its_settings_and_waits_for_the_operator_s_topology(secured):
    settings = CommonSettings(
        nats_url=secured.url, nats_user="filter", nats_password=secured.passwords["filter"], manage_topology=False
    )
    nc = await jetstream.connect(settings.nats_url, "test", **jetstream.connect_options(settings))
    try:
        await asyncio.wait_for(jetstream.prepare_topology(nc.jetstream(), settings, "filter"), 5)
        assert "Permissions Violation" not in secured.log.read_text()
    finally:
        await nc.close()


# ---- TLS ---------------------------------------------------------------------------


def make_certs(tmp: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(cn, key, issuer, issuer_key, ca=False, usage=None, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage:
            b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    out: dict[str, Path] = {}

    def write(stem: str, cert, key) -> None:
        out[f"{stem}_cert"] = tmp / f"{stem}.crt"
        out[f"{stem}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{stem}_key"] = tmp / f"{stem}.key"
        out[f"{stem}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("arena-test-ca", ca_key, name("arena-test-ca"), ca_key, ca=True)
    write("ca", ca, ca_key)
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    write(
        "server",
        build("127.0.0.1", server_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, san=san),
        server_key,
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    write(
        "client",
        build("arena-client", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH),
        client_key,
    )
    return out


async def test_nats_over_tls_with_client_certificates_and_users(tmp_path):
    certs = make_certs(tmp_path)
    passwords = nats_auth.new_passwords()
    config = tmp_path / "nats.conf"
    tls = {
        "cert_file": str(certs["server_cert"]),
        "key_file": str(certs["server_key"]),
        "ca_file": str(certs["ca_cert"]),
    }
    config.write_text(nats_auth.server_config(passwords, tls=tls))
    server = start_nats(tmp_path / "store", config=config, tls=True)
    try:
        assert server.url.startswith("tls://")
        settings = CommonSettings(
            nats_url=server.url,
            nats_user="inference",
            nats_password=passwords["inference"],
            nats_tls_ca=str(certs["ca_cert"]),
            nats_tls_cert=str(certs["client_cert"]),
            nats_tls_key=str(certs["client_key"]),
        )
        nc = await jetstream.connect(settings.nats_url, "tls-test", **jetstream.connect_options(settings))
        try:
            assert (await nc.jetstream().account_info()) is not None
        finally:
            await nc.close()
        # The operator's commands read the same settings: the topology, then an audit, over TLS.
        operator = {
            **user_env(),
            "NATS_URL": server.url,
            "ARENA_NATS_USER": nats_auth.OPERATOR,
            "ARENA_NATS_PASSWORD": passwords[nats_auth.OPERATOR],
            "ARENA_NATS_TLS_CA": str(certs["ca_cert"]),
            "ARENA_NATS_TLS_CERT": str(certs["client_cert"]),
            "ARENA_NATS_TLS_KEY": str(certs["client_key"]),
        }
        for command in (["topology"], ["audit", "--since", "1h", "--state-dir", str(tmp_path / "no-state")]):
            done = await asyncio.to_thread(arena, *command, env=operator)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
        # Without the client certificate the server refuses the handshake.
        no_cert = CommonSettings(
            nats_url=server.url,
            nats_user="inference",
            nats_password=passwords["inference"],
            nats_tls_ca=str(certs["ca_cert"]),
        )
        with pytest.raises(Exception):  # noqa: B017 - nats-py surfaces the TLS failure as several types
            await nats.connect(
                server.url, allow_reconnect=False, connect_timeout=2, **jetstream.connect_options(no_cert)
            )
    finally:
        server.stop()


def _redis_has_tls(binary: str) -> bool:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    probe = subprocess.run(
        [binary, "--port", "0", "--tls-port", "1", "--tls-cert-file", "/nonexistent"],
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    )
    return (
        "v=" in out
        and "not supported" not in (probe.stdout + probe.stderr).lower()
        and "Bad directive" not in (probe.stdout + probe.stderr)
    )


async def test_redis_over_tls_from_a_rediss_url(tmp_path):
    binary = redis_server_binary()
    if not _redis_has_tls(binary):
        pytest.fail(f"{binary} was built without TLS: install Debian's redis-server (TLS built in)")
    certs = make_certs(tmp_path)
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port", "0",
            "--bind", "127.0.0.1",
            "--tls-port", str(port),
            "--tls-cert-file", str(certs["server_cert"]),
            "--tls-key-file", str(certs["server_key"]),
            "--tls-ca-cert-file", str(certs["ca_cert"]),
            "--tls-auth-clients", "no",
            "--save", "",
            "--dir", str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_port(port, proc)
        client = redis_client(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs['ca_cert']}")
        await client.set("arena:tls", "yes")
        assert await client.get("arena:tls") == b"yes"
        await client.aclose()
        plain = redis_client(f"redis://127.0.0.1:{port}/0", retries=0)
        with pytest.raises(Exception):  # noqa: B017 - a plain client on a TLS port: reset or garbage
            await plain.ping()
        await plain.aclose()
    finally:
        proc.terminate()
        proc.wait(5)
