-- What a relay runs (relay/postgres/store.py, listener.py, doorbell.py), as the relay role:
-- claims, leases, settles, the rescue, the doorbell, and the gauges' readings.
-- `{schema}` is replaced by the quoted, validated schema name and `{new_channel}` by the quoted
-- NOTIFY channel; nothing else is ever spliced into these texts.

-- name: claim
-- Lease due rows under a new claim id (expired leases first), counting the attempt, from this
-- relay's cursors (migration 0026, docs/decisions/0004). Only ids and sizes come back, in one
-- row: the claim has committed before any row travels (`fetch`), so a relay frozen while it
-- reads holds no lock. SKIP LOCKED lets replicas claim side by side; leases are judged by the
-- database's clock, never a relay's.
SELECT ids, sizes, more, alone, due_at, due_id, orphan_at, orphan_id, buried, buried_attempts
FROM {schema}.claim(%(request)s::{schema}.claim_request);

-- name: fetch
-- The claimed rows themselves, still under the claim (a page of them: the store keeps each page
-- small enough to sit in the sockets' buffers, so a reader that stops holds nothing here either).
-- Found by id: `IS NOT DISTINCT FROM`, not `=`, so that the planner cannot walk
-- messages_leased_idx instead, whose dead entries a pinned vacuum horizon keeps (migration 0028).
-- headers and properties come back as text: the relay decodes them row by row, so one row it
-- cannot read is dead-lettered on its own.
SELECT id, message_id, exchange, routing_key, body, headers::text AS headers,
       properties::text AS properties, ordering_key, created_at, attempts, ambiguous, last_error,
       seq, replays, replayed_at, replayed_from
FROM {schema}.messages
WHERE id = ANY(%(ids)s::bigint[]) AND claim_id IS NOT DISTINCT FROM %(claim_id)s::uuid
ORDER BY id;

-- name: settle
-- Every transition of one claim, in one transaction, then (with a request) the next claim in the
-- same round trip (migration 0026).
SELECT archived, dead, retried, released, blocked, ids, sizes, more, alone, due_at, due_id,
       orphan_at, orphan_id, buried, buried_attempts
FROM {schema}.settle(
    %(claim_id)s, %(ids)s::bigint[], %(fates)s::text[], %(reasons)s::text[], %(notes)s::text[],
    %(delays)s::float8[], %(resent)s::bigint[], %(durable)s, %(request)s::{schema}.claim_request);

-- name: extend_leases
-- A heartbeat, or the check before publishing: push the lease of rows this claim still holds and
-- say which those are (rows re-claimed elsewhere are skipped, and must not be published).
SELECT id FROM {schema}.extend_leases(%(claim_id)s, %(ids)s::bigint[], %(lease)s) AS id;

-- name: behind
-- The rescue (a chore beside the loop): the oldest due row behind the relay's due cursor and the
-- oldest expired lease behind its orphan cursor, if any (a row that committed long after its
-- insert, a claim that rolled back); the claim's cursors move back to them.
SELECT d.available_at AS due_at, d.id AS due_id, o.available_at AS orphan_at, o.id AS orphan_id
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT available_at, id FROM {schema}.messages
    WHERE claim_id IS NULL AND NOT gated
      AND (available_at, id) < (%(due_at)s::timestamptz, %(due_id)s::bigint)
    ORDER BY available_at, id LIMIT 1) AS d ON true
LEFT JOIN LATERAL (
    SELECT available_at, id FROM {schema}.messages
    WHERE claim_id IS NOT NULL
      AND (available_at, id) < (%(orphan_at)s::timestamptz, %(orphan_id)s::bigint)
    ORDER BY available_at, id LIMIT 1) AS o ON true;

-- name: message_stats
-- `outbox-relay stats`: every row of messages by state. due = may be claimed now (a lease that
-- ran out included), scheduled = later, gated = behind an earlier message of its key; pending is
-- all three.
SELECT
    count(*) FILTER (WHERE NOT leased) AS pending,
    count(*) FILTER (WHERE NOT leased AND NOT gated AND available_at <= now()) AS due,
    count(*) FILTER (WHERE NOT leased AND NOT gated AND available_at > now()) AS scheduled,
    count(*) FILTER (WHERE NOT leased AND gated) AS gated,
    count(*) FILTER (WHERE leased) AS in_flight,
    extract(epoch FROM now() - min(created_at)
                               FILTER (WHERE NOT leased AND NOT gated AND available_at <= now()))
        AS oldest_pending_age
FROM (
    SELECT created_at, available_at, gated,
           claim_id IS NOT NULL AND available_at > now() AS leased
    FROM {schema}.messages
) AS m;

-- name: blocked_key_count
SELECT count(*) FROM {schema}.blocked_keys;

-- name: archive_count
SELECT count(*) FROM {schema}.archive;

-- name: dead_by_reason
SELECT reason, count(*) FROM {schema}.dead GROUP BY reason ORDER BY reason;

-- name: listen
LISTEN {new_channel};

-- name: arm_doorbell
-- SHARE on the doorbell, once every producer that holds it has committed (migration 0023): from
-- now on producers NOTIFY. Held, in an open READ COMMITTED transaction, while the relay sleeps.
SELECT {schema}.arm_doorbell();

-- name: doorbell_session
-- The doorbell's session waits for its lock as long as producers hold it, then holds it in an
-- idle transaction as long as its relay sleeps: no timeout of the server's may end either. The
-- server's TCP keepalives notice a client gone silently (a NAT that dropped the connection), so
-- that the lock does not outlive it by hours (no effect over a Unix socket).
SELECT set_config('lock_timeout', '0', false), set_config('statement_timeout', '0', false),
       set_config('idle_in_transaction_session_timeout', '0', false),
       set_config('tcp_keepalives_idle', %(keepalive)s, false),
       set_config('tcp_keepalives_interval', %(keepalive)s, false);

-- name: no_idle_session_timeout
-- PostgreSQL 14's idle_session_timeout would end the doorbell's session between two arms, and the
-- LISTEN session whenever no NOTIFY comes for that long: off, for these two sessions.
SELECT set_config('idle_session_timeout', '0', false);

-- name: doorbell_no_transaction_timeout
-- PostgreSQL 17's transaction_timeout would end it while it holds the doorbell: off.
SELECT set_config('transaction_timeout', '0', false);

-- name: use_doorbell
-- From now on producers NOTIFY only while a relay sleeps (a relay of this version is running).
SELECT {schema}.use_doorbell();

-- name: relay_session
-- Each pooled connection of a relay. Its claims are durable before anything is published: a
-- server that does not wait for the WAL flush by default (`off`) is overruled for this session
-- (stricter settings are kept); settles may then opt out (settle's p_durable). It reads committed
-- data: the key gate's decisions rest on what each statement sees committed. And no statement of
-- its waits for a lock, or holds a transaction open while the relay does not answer, longer than
-- %(lock_timeout)s ms (OUTBOX_LOCK_TIMEOUT).
SELECT set_config('synchronous_commit', 'on', false)
WHERE current_setting('synchronous_commit') = 'off'
UNION ALL
SELECT set_config('default_transaction_isolation', 'read committed', false)
UNION ALL
SELECT set_config('lock_timeout', %(lock_timeout)s, false)
UNION ALL
SELECT set_config('idle_in_transaction_session_timeout', %(lock_timeout)s, false);

-- name: relay_settings
-- What relay_session sets, read instead behind a transaction pooler (where it must be the role's).
SELECT current_setting('synchronous_commit'), current_setting('default_transaction_isolation'),
       current_setting('lock_timeout'), current_setting('idle_in_transaction_session_timeout'),
       quote_ident(current_user);

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations;

-- name: observe
-- The gauges' one query: backlog by state, the longest wait, dead rows, blocked keys, and the
-- database's health. Every count of messages reads an index (capped at a million), never the
-- table, and the due ones from the relay's cursors (%(due_at)s, %(orphan_at)s; NULL: from the
-- start): behind them lie only the rows the claims went past, dead ones a pinned vacuum horizon
-- keeps, which a gauge every few seconds must not read again and again.
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NULL AND NOT gated AND available_at <= now()
                             AND available_at >= coalesce(%(due_at)s::timestamptz, '-infinity')
                           LIMIT 1000000) AS s)
    -- leases that ran out (their relay died): due again
    + (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                             WHERE claim_id IS NOT NULL AND available_at <= now()
                               AND available_at >= coalesce(%(orphan_at)s::timestamptz, '-infinity')
                             LIMIT 1000000) AS s) AS due,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NULL AND NOT gated AND available_at > now()
                           LIMIT 1000000) AS s) AS scheduled,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages WHERE gated
                           LIMIT 1000000) AS s) AS gated,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NOT NULL AND available_at > now()
                           LIMIT 1000000) AS s) AS in_flight,
    extract(epoch FROM now() - (SELECT available_at FROM {schema}.messages
                                WHERE claim_id IS NULL AND NOT gated AND available_at <= now()
                                  AND available_at >= coalesce(%(due_at)s::timestamptz, '-infinity')
                                ORDER BY available_at, id LIMIT 1)) AS oldest_due,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.dead LIMIT 1000000) AS s) AS dead,
    (SELECT count(*) FROM {schema}.blocked_keys) AS blocked_keys,
    (SELECT n_dead_tup FROM pg_stat_user_tables
     WHERE relid = to_regclass(%(messages)s)) AS dead_tuples,
    (SELECT extract(epoch FROM last_autovacuum) FROM pg_stat_user_tables
     WHERE relid = to_regclass(%(messages)s)) AS last_autovacuum,
    -- Off for the server or for the table: the queue bloats and its statistics go stale.
    (SELECT current_setting('autovacuum')::boolean
            AND coalesce((SELECT option_value::boolean FROM pg_options_to_table(c.reloptions)
                          WHERE option_name = 'autovacuum_enabled'), true)
     FROM pg_class AS c WHERE c.oid = to_regclass(%(messages)s)) AS autovacuum_on,
    h.seconds, h.xids, h.pid, h.state
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    -- Who holds back the vacuum horizon: the session with the oldest snapshot.
    SELECT extract(epoch FROM now() - coalesce(xact_start, query_start)) AS seconds,
           age(backend_xmin) AS xids, pid, state
    FROM pg_stat_activity
    WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    ORDER BY age(backend_xmin) DESC
    LIMIT 1
) AS h ON true;

-- name: table_inserts
-- Rows ever inserted into each outbox table, from PostgreSQL's statistics (cheap; refreshed by
-- PostgreSQL about once a second): differences over time give enqueue, publish and dead rates.
SELECT relname, n_tup_ins
FROM pg_stat_user_tables
WHERE schemaname = %(schema)s AND relname IN ('messages', 'archive', 'dead');
