"""TLS to both servers, through TLS listeners the tests run (a CA of their own, made per test)."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest
import trustme

import relay
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env, run_cli
from tests.support.proxy import TcpProxy


@dataclass(frozen=True)
class Pki:
    """A CA, a server certificate for `localhost` only, and a client certificate, as PEM files."""

    ca: trustme.CA
    server: trustme.LeafCert
    ca_file: Path
    client_cert: Path
    client_key: Path
    stranger_ca_file: Path  # a CA that signed nothing here

    def server_context(self, *, require_client_cert: bool = False) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server.configure_cert(context)
        if require_client_cert:
            self.ca.configure_trust(context)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = trustme.CA()
    server = ca.issue_cert("localhost")
    client = ca.issue_cert("outbox-relay@example.test")
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    client.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "stranger.pem"))
    return Pki(
        ca,
        server,
        tmp_path / "ca.pem",
        tmp_path / "client.pem",
        tmp_path / "client.key",
        tmp_path / "stranger.pem",
    )


@pytest.fixture
def amqps(pki: Pki, amqp_url: str) -> Iterator[tuple[TcpProxy, str]]:
    """A TLS listener in front of RabbitMQ that insists on a client certificate; the amqps://
    URL that reaches it by the name its certificate carries."""
    parts = urlsplit(amqp_url)
    context = pki.server_context(require_client_cert=True)
    with TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5672, tls=context) as proxy:
        credentials = parts.netloc.rpartition("@")[0]
        yield proxy, f"amqps://{credentials}@localhost:{proxy.port}{parts.path or '/'}"


async def test_relay_publishes_over_amqps_with_a_client_certificate(
    database_url: str, broker: Broker, pki: Pki, amqps: tuple[TcpProxy, str]
) -> None:
    proxy, url = amqps
    await broker.declare(binding="tls.#")
    with psycopg.connect(database_url) as conn:
        message_id = relay.enqueue(conn, broker.exchange, "tls.a", b"over tls")
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=url,
        OUTBOX_AMQP_CA_FILE=str(pki.ca_file),
        OUTBOX_AMQP_CERT_FILE=str(pki.client_cert),
        OUTBOX_AMQP_KEY_FILE=str(pki.client_key),
    )
    with RelayProcess(env, "--until-empty") as proc:
        proc.wait_for("no due rows left")
        assert proc.exited() == 0, proc.output
    received = await broker.collect(1)
    assert [(m.message_id, m.body) for m in received] == [(str(message_id), b"over tls")]
    assert proxy.accepted >= 1  # it went through the TLS listener, not around it


@pytest.mark.parametrize(
    ("problem", "fragment"),
    [
        ("untrusted CA", "certificate verify failed"),
        ("wrong host name", "certificate verify failed"),
        ("no client certificate", "RabbitMQ unavailable"),
    ],
)
def test_amqps_refuses_what_it_cannot_verify(
    database_url: str, pki: Pki, amqps: tuple[TcpProxy, str], problem: str, fragment: str
) -> None:
    _, url = amqps
    settings = {
        "OUTBOX_AMQP_CA_FILE": str(pki.ca_file),
        "OUTBOX_AMQP_CERT_FILE": str(pki.client_cert),
        "OUTBOX_AMQP_KEY_FILE": str(pki.client_key),
    }
    if problem == "untrusted CA":
        settings["OUTBOX_AMQP_CA_FILE"] = str(pki.stranger_ca_file)
    elif problem == "wrong host name":  # the certificate names localhost, not 127.0.0.1
        url = url.replace("@localhost:", "@127.0.0.1:")
    else:
        del settings["OUTBOX_AMQP_CERT_FILE"], settings["OUTBOX_AMQP_KEY_FILE"]
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=url,
        OUTBOX_STARTUP_TIMEOUT="2",
        **settings,
    )
    result = run_cli("run", "--until-empty", env=env)
    assert result.returncode != 0
    assert fragment in result.stderr
    assert "guest:guest" not in result.stderr


def test_tls_files_without_amqps_are_a_config_error(database_url: str, pki: Pki) -> None:
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL="amqp://guest:guest@127.0.0.1:5672/",
        OUTBOX_AMQP_CA_FILE=str(pki.ca_file),
    )
    result = run_cli("run", env=env)
    assert result.returncode == 2, result.stderr
    assert "need an amqps:// OUTBOX_AMQP_URL" in result.stderr


@pytest.fixture
def pg_tls(pki: Pki, database_url: str) -> Iterator[str]:
    """A PostgreSQL TLS listener (SSLRequest, then TLS) in front of the server; the database's
    URL through it by the certificate's name, with no TLS options yet."""
    parts = urlsplit(database_url)
    context = pki.server_context()
    with TcpProxy(
        parts.hostname or "127.0.0.1", parts.port or 5432, tls=context, postgres=True
    ) as proxy:
        user = parts.netloc.rpartition("@")[0]
        yield parts._replace(netloc=f"{user}@localhost:{proxy.port}").geturl()


async def test_relay_reaches_postgres_over_verified_tls(
    pg_tls: str, pki: Pki, broker: Broker, amqp_url: str
) -> None:
    url = f"{pg_tls}?sslmode=verify-full&sslrootcert={pki.ca_file}"
    await broker.declare(binding="tls.#")
    with psycopg.connect(url) as conn:
        assert conn.pgconn.ssl_in_use
        relay.enqueue(conn, broker.exchange, "tls.pg", b"via tls")
    env = clean_env(OUTBOX_DATABASE_URL=url, OUTBOX_AMQP_URL=amqp_url)
    with RelayProcess(env, "--until-empty") as proc:
        proc.wait_for("no due rows left")
        assert proc.exited() == 0, proc.output
    assert [m.body for m in await broker.collect(1)] == [b"via tls"]


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ("sslmode=verify-full&sslrootcert={stranger}", "certificate verify failed"),
        ("sslmode=disable", "PostgreSQL unavailable"),
    ],
)
def test_postgres_tls_refuses_what_it_cannot_verify(
    pg_tls: str, pki: Pki, amqp_url: str, options: str, fragment: str
) -> None:
    url = f"{pg_tls}?{options.format(stranger=pki.stranger_ca_file)}"
    env = clean_env(OUTBOX_DATABASE_URL=url, OUTBOX_AMQP_URL=amqp_url, OUTBOX_STARTUP_TIMEOUT="2")
    result = run_cli("run", "--until-empty", env=env)
    assert result.returncode != 0
    assert fragment in result.stderr
