"""The named-query loader: every name present, schema names quoted, nothing else spliced in."""

from __future__ import annotations

import dataclasses

import pytest

from relay.core import errors
from relay.postgres import roles, sql


def test_every_query_is_loaded_and_bound_to_the_schema() -> None:
    queries = sql.load("my_outbox")
    for field in dataclasses.fields(queries):
        text = getattr(queries, field.name)
        assert text
        assert "{schema}" not in text
        assert "{new_channel}" not in text
        assert not text.rstrip().endswith(";")
    assert '"my_outbox".claim(' in queries.claim
    assert queries.listen == 'LISTEN "my_outbox_new"'


def test_parse_splits_on_name_headers_and_drops_comments() -> None:
    parsed = sql.parse(
        "-- file comment\n-- name: a\n-- about a\nSELECT 1;\n\n-- name: b\nSELECT 2\n"
    )
    assert parsed == {"a": "SELECT 1", "b": "SELECT 2"}


@pytest.mark.parametrize("schema", ['x" ; DROP SCHEMA outbox CASCADE; --', "x.y", "x y"])
def test_unsafe_schema_never_reaches_sql(schema: str) -> None:
    with pytest.raises(errors.ConfigError):
        sql.load(schema)


def test_migrate_grants_roles_sql_without_taking_anything_away() -> None:
    # Relays of the previous release keep their rights through a rolling upgrade: `migrate`
    # applies only roles.sql's grants; `outbox-relay roles` applies the whole file.
    additive = roles.grants("outbox", revoke=False)
    assert "REVOKE" not in additive.upper()
    assert "GRANT EXECUTE" in additive
    assert "GRANT USAGE" in additive
    assert roles.grants("outbox").upper().count("REVOKE ALL") == 3


def test_migrate_leaves_out_only_the_grants_of_roles_an_earlier_roles_did_not_create() -> None:
    # An installation set up by an earlier `roles` has no viewer role until `roles` runs again:
    # `migrate` grants the others all of theirs meanwhile.
    every = roles.grants("outbox", revoke=False)
    earlier = roles.grants("outbox", revoke=False, without=roles.LATER)
    assert roles.LATER == ("viewer",)
    assert '"outbox_viewer"' in every
    assert '"outbox_viewer"' not in earlier
    for name in ("outbox_producer", "outbox_relay", "outbox_operator"):
        assert earlier.count(f'"{name}"') == every.count(f'"{name}"') > 0
    with pytest.raises(ValueError, match="REVOKE"):
        roles.grants("outbox", without=roles.LATER)  # `roles` creates every role first


def test_role_names_are_never_truncated() -> None:
    made = roles.names("s" * 54)
    assert made.names() == tuple(f"{'s' * 54}_{job}" for job in roles.JOBS)
    assert max(len(name) for name in made.names()) == 63
    with pytest.raises(errors.ConfigError, match="at most 54 characters"):
        roles.names("s" * 55)
