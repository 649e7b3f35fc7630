"""Settings: defaults, the environment, flags, durations, identifiers and redaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.console import settings as settings_file
from relay.core import config, describe, errors, values


def test_defaults_match_the_documented_contract() -> None:
    settings = config.load()
    assert (
        settings.database_url.get_secret_value() == "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    assert settings.amqp_url.get_secret_value() == "amqp://guest:guest@127.0.0.1:5672/"
    assert settings.db_schema == "outbox"
    assert (settings.batch_size, settings.poll_interval, settings.max_attempts) == (500, 1.0, 10)


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SCHEMA", "from_env")
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "42")
    assert (config.load().db_schema, config.load().batch_size) == ("from_env", 42)
    assert config.load(db_schema="from_flag", batch_size=None).db_schema == "from_flag"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1.5", 1.5),
        (2, 2.0),
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        (" 10 s ", 10.0),
        (".5", 0.5),
        ("-1s", -1.0),  # read, so that the setting's range names what is wrong with it
    ],
)
def test_durations(text: object, seconds: float) -> None:
    assert values.parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "--1s", "1w", "", "1.2.3", True])
def test_bad_durations(text: object) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        values.parse_duration(text)


@pytest.mark.parametrize("name", ["outbox", "Outbox_2", "_x", "a" * 59])
def test_good_identifiers(name: str) -> None:
    assert values.check_identifier(name) == name


@pytest.mark.parametrize("name", ['a"b', "a b", "1a", "", "a" * 60, "pg_toast", "PG_x", "é", "a;b"])
def test_bad_identifiers(name: str) -> None:
    with pytest.raises(errors.ConfigError, match="invalid schema name"):
        values.check_identifier(name)


def test_secrets_never_appear_in_the_settings_repr() -> None:
    settings = config.load(database_url="postgresql://u:pw1@h/db", amqp_url="amqp://u:pw2@h/")
    assert "pw1" not in repr(settings)
    assert "pw2" not in repr(settings)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("postgresql://u:p@h/db", "postgresql://u:***@h/db"),
        ("x amqp://guest:gu@st@h:5/ y", "x amqp://guest:***@h:5/ y"),
        ("postgresql://h/db and amqps://a:b@c/", "postgresql://h/db and amqps://a:***@c/"),
        ("no url here", "no url here"),
        # libpq's key/value form, quoted or not, and the password as a URL parameter
        (
            "host=db user=relay password=s3cret dbname=app",
            "host=db user=relay password=*** dbname=app",
        ),
        ("password = 's3 cr\\'et' host=db", "password = *** host=db"),
        ("host=db PASSWORD=s3cret", "host=db PASSWORD=***"),
        (
            "postgresql://relay@db/app?sslmode=require&password=s3cret",
            "postgresql://relay@db/app?sslmode=require&password=***",
        ),
        ("postgresql:///app?password=s3cret&host=db", "postgresql:///app?password=***&host=db"),
        ("postgresql://relay@db/app?password=s3%40cret", "postgresql://relay@db/app?password=***"),
        ("a password of 3 words", "a password of 3 words"),
        ("host=db sslpassword=keypass sslkey=/k", "host=db sslpassword=*** sslkey=/k"),
    ],
)
def test_redaction(text: str, expected: str) -> None:
    assert values.redact_secrets(text) == expected


def test_errors_name_the_setting_the_way_it_came_in(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(errors.ConfigError, match="--max-attempts: Input should be greater"):
        config.load(max_attempts=0)  # as a flag passes it
    monkeypatch.setenv("OUTBOX_MAX_ATTEMPTS", "0")
    with pytest.raises(errors.ConfigError, match="OUTBOX_MAX_ATTEMPTS: Input should be greater"):
        config.load()


@pytest.mark.parametrize("given", ["-1", "-250ms", -1])
def test_a_negative_duration_is_out_of_range_not_unreadable(given: str | int) -> None:
    with pytest.raises(errors.ConfigError, match="--lease: Input should be greater than 0"):
        config.load(lease=given)


def test_unknown_outbox_variables_are_named_with_the_closest_setting() -> None:
    environ = {
        "OUTBOX_DATABSE_URL": "postgresql://x",
        "OUTBOX_LEASE": "5",
        "OUTBOX_DATABASE_URL_FILE": "/run/secrets/db",
        "OUTBOX_LAKE": "/lake",
        "OUTBOX_WHATEVER": "1",
        "PATH": "/bin",
    }
    assert settings_file.unknown_variables(environ) == [
        ("OUTBOX_DATABSE_URL", "OUTBOX_DATABASE_URL"),
        ("OUTBOX_WHATEVER", None),
    ]


def test_secrets_can_come_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db, mq = tmp_path / "db", tmp_path / "mq"
    db.write_text("postgresql://relay:s3cret@db.internal/app?sslmode=verify-full\n")
    mq.write_text("amqps://relay:an0ther@mq.internal/\n")
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(db))
    monkeypatch.setenv("OUTBOX_AMQP_URL_FILE", str(mq))
    settings = config.load()
    assert settings.database_url.get_secret_value() == (
        "postgresql://relay:s3cret@db.internal/app?sslmode=verify-full"
    )
    assert settings.amqp_url.get_secret_value() == "amqps://relay:an0ther@mq.internal/"


def test_a_secret_file_is_checked_like_the_setting_and_never_echoed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "db"
    secret.write_text("mysql://relay:s3cret@db.internal/app")
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(secret))
    with pytest.raises(errors.ConfigError) as bad:
        config.load()
    assert "OUTBOX_DATABASE_URL" in str(bad.value)
    assert "s3cret" not in str(bad.value)
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(errors.ConfigError, match=r"cannot read OUTBOX_DATABASE_URL_FILE .*No such"):
        config.load()
    monkeypatch.setenv("OUTBOX_DATABASE_URL_FILE", str(secret))
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://x@y/z")
    with pytest.raises(errors.ConfigError, match="not both"):
        config.load()


def test_every_setting_is_described_from_its_definition_alone() -> None:
    """Type, default, range and variable come from the field: nothing to keep in step by hand."""
    fields = {**config.Settings.model_fields, **config.PipelineSettings.model_fields}
    for field, info in fields.items():
        described = describe.describe(field)
        assert described.help.startswith(str(info.description)), field
        assert described.help.endswith(f"env: {config.env_name(field)}]"), field
    lease = describe.describe("lease")
    assert lease.metavar == "SECONDS"
    assert "[default: 10; > 0; or 250ms, 30s, 5m, 2h, 7d; env: OUTBOX_LEASE]" in lease.help
    batch = describe.describe("batch_size")
    assert batch.metavar == "INTEGER"
    assert "[default: 500; ≥ 1; ≤ 10000; env: OUTBOX_BATCH_SIZE]" in batch.help
    assert describe.describe("synchronous_commit").metavar == "BOOLEAN"
    assert "default: false" in describe.describe("synchronous_commit").help
    amqp = describe.describe("amqp_url")
    assert "guest:***@" in amqp.help
    assert "guest:guest" not in amqp.help
    assert "default" not in describe.describe("relay_name").help.split("[", 1)[1]  # host:pid


def test_every_relay_setting_is_a_flag_of_run() -> None:
    from relay.console import options as base

    assert set(base.CONNECTION) | set(base.RELAY_KNOBS) == set(config.Settings.model_fields)


@pytest.mark.parametrize("field", ["database_url", "listen_url"])
def test_a_url_libpq_would_refuse_by_quoting_its_password_is_refused_without_it(
    field: str,
) -> None:
    with pytest.raises(errors.ConfigError, match="not a %XX escape") as refused:
        config.load(**{field: "postgresql://app:s3cr%zzet@db/app"})
    assert "s3cr" not in str(refused.value)
    assert config.load(**{field: "postgresql://app:s3cr%25et@db/app"})  # a % written as %25
