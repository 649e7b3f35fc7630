"""Frozen relay settings read from OUTBOX_* environment variables and command-line flags."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

import pydantic
from pydantic import BeforeValidator, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from relay.core import errors
from relay.core.values import check_identifier, parse_duration

#: Seconds, given as a number or with a unit ("90s", "5m", "1h"; values.parse_duration).
Duration = Annotated[float, BeforeValidator(parse_duration)]

#: Settings that may also come from a file named by OUTBOX_<NAME>_FILE.
SECRETS = ("database_url", "amqp_url", "listen_url")


def _default_relay_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _Database(BaseSettings):
    """The settings every command that talks to the outbox database shares."""

    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_", frozen=True, populate_by_name=True, extra="forbid"
    )

    database_url: SecretStr = Field(
        SecretStr("postgresql://postgres@127.0.0.1:5432/postgres"),
        description="PostgreSQL connection URL (libpq syntax; `sslmode` etc. as query parameters).",
    )
    db_schema: str = Field(
        "outbox",
        validation_alias="OUTBOX_SCHEMA",
        description="PostgreSQL schema holding the outbox tables and functions.",
    )
    transaction_pooler: bool = Field(
        False,
        description="OUTBOX_DATABASE_URL goes through a transaction-mode pooler (PgBouncer's "
        "`pool_mode = transaction`): no prepared statements and no session settings (the relay "
        "checks the role's instead); NOTIFY cannot come through it (see OUTBOX_LISTEN_URL).",
    )

    @pydantic.model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        """`OUTBOX_<SECRET>_FILE` names a file holding the secret (a Kubernetes or Docker secret),
        so it need not sit in the environment, where `ps e` and crash dumps can show it."""
        if not isinstance(data, dict):
            return data
        for field in SECRETS:
            if field not in cls.model_fields:
                continue
            variable = f"{env_name(field)}_FILE"
            path = os.environ.get(variable)
            if path is None:
                continue
            if data.get(field) is not None:
                raise ValueError(f"set {env_name(field)} or {variable}, not both")
            try:
                with open(path, encoding="utf-8") as secret:
                    data = {**data, field: secret.read().strip()}
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ValueError(f"cannot read {variable} ({path}): {reason}") from None
        return data

    @field_validator("db_schema")
    @classmethod
    def _schema_is_identifier(cls, value: str) -> str:
        try:
            return check_identifier(value)
        except errors.ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("database_url")
    @classmethod
    def _database_url_scheme(cls, value: SecretStr) -> SecretStr:
        return _check_scheme(value, ("postgresql", "postgres"))


class Settings(_Database):
    """Every knob of the relay. Field descriptions are docs/reference/settings.md."""

    listen_url: SecretStr | None = Field(
        None,
        description="A PostgreSQL URL used only to LISTEN for producers' NOTIFY, for a relay "
        "whose OUTBOX_DATABASE_URL goes through a transaction pooler: a direct one. Unset: "
        "OUTBOX_DATABASE_URL, or, with OUTBOX_TRANSACTION_POOLER, none (the relay then polls "
        "every OUTBOX_POLL_INTERVAL).",
    )
    doorbell: bool = Field(
        True,
        description="Arm the doorbell (migration 0023, docs/decisions/0008) while the relay "
        "sleeps, so that producers notify only then and their commits stop queueing behind "
        "NOTIFY's lock. Needs a LISTEN connection. Off: the relay opens no doorbell session, and "
        "while no relay holds it every enqueue notifies, as before 0023.",
    )

    amqp_url: SecretStr = Field(
        SecretStr("amqp://guest:guest@127.0.0.1:5672/"),
        description="RabbitMQ connection URL (`amqp://` or `amqps://`).",
    )
    amqp_ca_file: str | None = Field(
        None,
        description="CA bundle (PEM) that signs the broker's certificate, for `amqps://`; "
        "unset: the system's trust store. The broker's host name is always verified.",
    )
    amqp_cert_file: str | None = Field(
        None,
        description="Client certificate (PEM) for brokers that require one (`amqps://`).",
    )
    amqp_key_file: str | None = Field(
        None,
        description="Private key (PEM) of the client certificate, if not in that file.",
    )
    batch_size: int = Field(500, ge=1, le=10_000, description="Rows claimed per batch.")
    batch_max_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024,
        le=2**31 - 1,
        description="A claimed batch stops growing at this many bytes of bodies, headers and "
        "properties (at least one message is taken); the relay holds at most two batches.",
    )
    poll_interval: Duration = Field(
        1.0, gt=0, description="Longest wait between claims when no NOTIFY arrives (seconds)."
    )
    lease: Duration = Field(
        10.0,
        gt=0,
        description="How long a claim holds its rows unless renewed; a dead relay's rows return "
        "after it (seconds). A relay renews what it holds every third of it, and publishes only "
        "within 90% of it from its last claim or renewal.",
    )
    lock_timeout: Duration = Field(
        5.0,
        gt=0,
        le=3600,
        description="No statement of the relay waits longer than this for a lock, and none of its "
        "transactions stays open longer than this while the relay does not answer (one frozen "
        "mid-statement): PostgreSQL's lock_timeout and idle_in_transaction_session_timeout for "
        "its sessions (seconds). A wait that times out is retried and counted, not an outage. "
        "Behind a transaction pooler, set both on the relay's role instead.",
    )
    confirm_timeout: Duration = Field(
        10.0, gt=0, description="How long a batch waits for publisher confirms (seconds)."
    )
    max_attempts: int = Field(
        10, ge=1, description="Publish attempts before a row is dead-lettered as `max_attempts`."
    )
    max_ambiguous: int = Field(
        5,
        ge=0,
        description="Re-sends after an unknown outcome (lost connection, confirm timeout) "
        "that do not count as attempts.",
    )
    retry_delay: Duration = Field(
        1.0, gt=0, description="First retry delay after a nack; doubles per attempt (seconds)."
    )
    retry_max_delay: Duration = Field(300.0, gt=0, description="Cap on the retry delay (seconds).")
    shutdown_timeout: Duration = Field(
        30.0,
        gt=0,
        description="On SIGTERM, how long the batch in flight may wait for its confirms before the "
        "rest is given back to other relays (seconds).",
    )
    startup_timeout: Duration = Field(
        15.0,
        ge=0,
        description="How long `run` retries unreachable services at start, then exits (seconds).",
    )
    relay_name: str = Field(
        default_factory=_default_relay_name,
        min_length=1,
        max_length=200,
        description="This replica's name, recorded on the rows it claims and in the "
        "outbox_relay_info metric (default `host:pid`, new at every restart: give a stable one, "
        "such as the pod's name, where the platform has one).",
    )
    log_level: str = Field("INFO", description="Logging level: DEBUG, INFO, WARNING or ERROR.")
    log_format: str = Field(
        "auto",
        description="`json`, `text`, or `auto`: JSON lines unless stderr is a terminal.",
    )
    event_loop: str = Field(
        "auto",
        description="`uvloop`, `asyncio`, or `auto`: uvloop when it is installed (about 1.4× the "
        "drain rate), else asyncio's own loop.",
    )
    synchronous_commit: bool = Field(
        False,
        description="Whether the relay's settles wait for the WAL flush (its claims always "
        "do). Off by default: losing a settle in a database crash only makes the relay send "
        "again what the broker already confirmed, under a new, counted claim; no message is "
        "lost (docs/guides/how-it-works.md).",
    )
    metrics_host: str = Field(
        "0.0.0.0",  # noqa: S104  # scraped from other hosts by default; narrow it with this setting
        min_length=1,
        description="Address the /metrics, /livez and /readyz endpoint binds to.",
    )
    metrics_port: int = Field(
        9464,
        ge=0,
        le=65535,
        description="Port of the /metrics, /livez and /readyz endpoint (0: any free port).",
    )
    stats_interval: Duration = Field(
        15.0,
        gt=0,
        description="How often the backlog and database-health gauges are refreshed (seconds).",
    )
    xmin_warning: Duration = Field(
        600.0,
        gt=0,
        description="Warn when a transaction has held back PostgreSQL's vacuum horizon this long "
        "(seconds).",
    )

    archive_retention: Duration = Field(
        604800.0,
        ge=0,
        description="Archived rows older than this are pruned by the relay, in small batches, by "
        "one replica at a time (seconds; default 7 days; 0 turns pruning off).",
    )
    archive_prune_interval: Duration = Field(
        3600.0, gt=0, description="How often the relay prunes the archive (seconds)."
    )

    @field_validator("amqp_url")
    @classmethod
    def _amqp_url_scheme(cls, value: SecretStr) -> SecretStr:
        return _check_scheme(value, ("amqp", "amqps"))

    @field_validator("listen_url")
    @classmethod
    def _listen_url_scheme(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else _check_scheme(value, ("postgresql", "postgres"))

    @field_validator("amqp_ca_file", "amqp_cert_file", "amqp_key_file")
    @classmethod
    def _readable_file(cls, value: str | None) -> str | None:
        if value is not None and not os.access(value, os.R_OK):
            raise ValueError(f"cannot read {value}")
        return value

    @pydantic.model_validator(mode="after")
    def _tls_files_need_amqps(self) -> Settings:
        files = (self.amqp_ca_file, self.amqp_cert_file, self.amqp_key_file)
        if any(files) and urlsplit(self.amqp_url.get_secret_value()).scheme != "amqps":
            raise ValueError(
                "OUTBOX_AMQP_CA_FILE, OUTBOX_AMQP_CERT_FILE and OUTBOX_AMQP_KEY_FILE need an "
                "amqps:// OUTBOX_AMQP_URL"
            )
        if self.amqp_key_file and not self.amqp_cert_file:
            raise ValueError("OUTBOX_AMQP_KEY_FILE needs OUTBOX_AMQP_CERT_FILE")
        return self

    @field_validator("log_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value.lower() not in {"auto", "json", "text"}:
            raise ValueError("use auto, json or text")
        return value.lower()

    @field_validator("event_loop")
    @classmethod
    def _known_loop(cls, value: str) -> str:
        if value.lower() not in {"auto", "uvloop", "asyncio"}:
            raise ValueError("use auto, uvloop or asyncio")
        return value.lower()

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        level = value.upper()
        if level not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ValueError("use DEBUG, INFO, WARNING or ERROR")
        return level


class PipelineSettings(_Database):
    """The data pipeline's knobs (`outbox-relay pipeline …`): where the lake is, how Spark runs."""

    lake: str = Field(
        "outbox-lake",
        min_length=1,
        description="Where the pipeline writes Parquet: a folder, or any Hadoop URL (`hdfs://`, "
        "`s3a://`, …) the Spark installation can write to.",
    )
    spark_master: str = Field(
        "local[*]",
        min_length=1,
        description="Spark master: `local[*]` (this machine), `spark://host:7077`, `yarn`, "
        "`k8s://…`. Under `spark-submit`, its `--master` wins.",
    )
    jdbc_jar: str = Field(
        "/usr/share/java/postgresql.jar",
        min_length=1,
        description="The PostgreSQL JDBC driver jar (Debian's `libpostgresql-jdbc-java`).",
    )
    export_partitions: int = Field(
        4, ge=1, le=1024, description="Parallel JDBC reads (connections) per exported id range."
    )
    export_chunk: int = Field(
        1_000_000,
        ge=1000,
        description="Ids per export range: the unit of resuming, re-writing and pruning.",
    )
    fetch_size: int = Field(
        10_000, ge=1, le=1_000_000, description="Rows per JDBC fetch round trip."
    )
    report_dir: str = Field(
        "outbox-report",
        min_length=1,
        description="Local folder for the human report (`report.md` and its PNG charts).",
    )


def _check_scheme(value: SecretStr, schemes: tuple[str, ...]) -> SecretStr:
    raw = value.get_secret_value()
    try:
        scheme = urlsplit(raw).scheme
        urlsplit(raw).port  # noqa: B018  # raises ValueError on a malformed port
    except ValueError:
        raise ValueError("not a valid URL") from None
    if scheme not in schemes:
        raise ValueError(f"must start with {' or '.join(s + '://' for s in schemes)}")
    if _BAD_ESCAPE.search(raw):  # else the driver's error quotes the text around it: a password
        raise ValueError("has a '%' that is not a %XX escape (write a '%' in a password as %25)")
    return value


#: A '%' not followed by two hex digits: libpq refuses the URL, quoting its neighbourhood.
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def env_name(field: str) -> str:
    """The environment variable that sets `field`."""
    info = Settings.model_fields.get(field) or PipelineSettings.model_fields[field]
    alias = info.validation_alias
    return alias if isinstance(alias, str) else f"OUTBOX_{field.upper()}"


def flag_name(field: str) -> str:
    """The command-line flag of a setting: OUTBOX_BATCH_SIZE → --batch-size."""
    return "--" + env_name(field).removeprefix("OUTBOX_").lower().replace("_", "-")


def _setting(loc: tuple[int | str, ...], flags: Mapping[str, Any]) -> str:
    """Name the setting an error is about the way it came in: its flag if one was given, else its
    environment variable."""
    name = str(loc[0]) if loc else "settings"
    known = Settings.model_fields.keys() | PipelineSettings.model_fields.keys()
    if name not in known:
        return name
    return flag_name(name) if flags.get(name) is not None else env_name(name)


def load(**overrides: Any) -> Settings:
    """Settings from the environment, overridden by flags; ConfigError if invalid."""
    return _load(Settings, overrides)


def load_pipeline(**overrides: Any) -> PipelineSettings:
    """The pipeline's settings from the environment, overridden by flags; ConfigError if invalid."""
    return _load(PipelineSettings, overrides)


_S = TypeVar("_S", bound=_Database)


def _load(kind: type[_S], overrides: dict[str, Any]) -> _S:
    try:
        return kind(**{k: v for k, v in overrides.items() if v is not None})
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            (f"{_setting(e['loc'], overrides)}: " if e["loc"] else "")
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors(include_url=False, include_input=False)
        )
        raise errors.ConfigError(f"invalid settings: {problems}") from None
