"""The pipeline's boundaries that need no Spark: the JDBC address, its settings, its command's
errors before any JVM starts, and that nothing outside the pipeline loads pyspark."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relay.core import config, errors
from relay.pipeline import jdbc
from tests.support.processes import assert_one_line_error, clean_env, run_cli


def test_a_libpq_url_becomes_a_jdbc_url_and_properties() -> None:
    url, props = jdbc.target(
        "postgresql://app:s3cret@db.example:6543/orders?sslmode=verify-full"
        "&sslrootcert=/etc/ca.pem&application_name=exporter&connect_timeout=5"
    )
    assert url == "jdbc:postgresql://db.example:6543/orders"
    assert "s3cret" not in url
    assert props == {
        "user": "app",
        "password": "s3cret",
        "driver": "org.postgresql.Driver",
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ca.pem",
        "ApplicationName": "exporter",
        "connectTimeout": "5",
        "prepareThreshold": "-1",
    }


def test_several_hosts_and_defaults() -> None:
    url, props = jdbc.target("postgresql://app@a,b:5433/db?target_session_attrs=read-write")
    assert url == "jdbc:postgresql://a:5432,b:5433/db"
    assert props["targetServerType"] == "primary"
    url, _ = jdbc.target("postgresql://app@h/weird%20name")
    assert url == "jdbc:postgresql://h:5432/weird%20name"


def test_behind_a_transaction_pooler_jdbc_prepares_nothing() -> None:
    _, direct = jdbc.target("postgresql://app@h/db")
    _, pooled = jdbc.target("postgresql://app@h/db", pooled=True)
    assert direct["prepareThreshold"] == "-1"  # binary transfer from the first fetch
    assert pooled == direct | {"prepareThreshold": "0"}


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("postgresql:///db?host=/var/run/postgresql", "Unix socket"),
        ("postgresql://h/db?gssencmode=disable", "'gssencmode' has no JDBC equivalent"),
        ("postgresql:///db?host=a,b,c&port=1,2", "different number of hosts and ports"),
    ],
)
def test_what_jdbc_cannot_do_is_a_config_error(url: str, fragment: str) -> None:
    with pytest.raises(errors.ConfigError, match=fragment):
        jdbc.target(url)


def test_pipeline_settings() -> None:
    settings = config.load_pipeline()
    assert (settings.lake, settings.spark_master, settings.export_chunk) == (
        "outbox-lake",
        "local[*]",
        1_000_000,
    )
    with pytest.raises(errors.ConfigError, match="--export-chunk"):
        config.load_pipeline(export_chunk="10")


def test_nothing_but_the_pipeline_loads_pyspark_or_matplotlib() -> None:
    probe = (
        "import sys, relay, relay.cli.commands, relay.app, relay.admin;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyspark', 'matplotlib')))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "env", "fragment"),
    [
        (["export", "--older-than", "soon"], {}, "--older-than: not a duration"),
        (["export", "--until", "someday"], {}, "not a time"),
        (["report", "--conf", "spark.driver.memory"], {}, "--conf wants KEY=VALUE"),
        (["export"], {"OUTBOX_JDBC_JAR": "/nowhere/pg.jar"}, "no PostgreSQL JDBC driver"),
        (["export"], {"PATH": "/nowhere", "JAVA_HOME": ""}, "needs Java 17"),
        (["export"], {"OUTBOX_EXPORT_PARTITIONS": "0"}, "OUTBOX_EXPORT_PARTITIONS"),
    ],
)
def test_pipeline_errors_are_one_line_before_any_jvm(
    args: list[str], env: dict[str, str], fragment: str
) -> None:
    result = run_cli("pipeline", *args, env=clean_env(**env))
    assert_one_line_error(result, 2, fragment)
