"""The project's settings, for `django.conf.settings.configure(**for_database(url))`.

Two aliases, `default` and `other`, name the same PostgreSQL database on separate connections
(Django's psycopg 3 backend); `lite` is SQLite, a backend relay.enqueue refuses."""

from __future__ import annotations

from typing import Any

from psycopg.conninfo import conninfo_to_dict

POSTGRES_ALIASES = ("default", "other")


def databases(database_url: str) -> dict[str, dict[str, Any]]:
    """DATABASES for the PostgreSQL aliases, pointed at `database_url`."""
    info = conninfo_to_dict(database_url)
    postgres = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": info.get("dbname", ""),
        "USER": info.get("user", ""),
        "PASSWORD": info.get("password", ""),
        "HOST": info.get("host", ""),
        "PORT": info.get("port", ""),
    }
    return {alias: dict(postgres) for alias in POSTGRES_ALIASES}


def for_database(database_url: str) -> dict[str, Any]:
    """Every setting the tests need, the databases pointed at `database_url`."""
    return {
        "DATABASES": databases(database_url)
        | {"lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        "INSTALLED_APPS": ["tests.django_app"],
        "USE_TZ": True,
        "TIME_ZONE": "UTC",
        "DEFAULT_AUTO_FIELD": "django.db.models.BigAutoField",
    }
