-- The locks that keep one migrate, one pruner and one pipeline run at a time per schema
-- (relay/postgres/locks.py). Transaction-scoped, taken in a transaction left open on a
-- connection of their own for as long as the work runs: through a transaction-mode pooler
-- (PgBouncer) a session-level lock would stay on whichever server connection took it and exclude
-- nothing. The keys are those of the session-level locks of earlier versions (the same text,
-- hashed alike), and the two kinds conflict: during a rolling upgrade old and new exclude each
-- other. Idle in a transaction with no xid and no snapshot, the holder does not hold back vacuum.

-- Waiting is trying again, in short transactions, so a waiter holds no pooled connection.
-- The holder also turns off, for its own transaction only, a server's
-- idle_in_transaction_session_timeout, which would otherwise end it (and the lock with it) while
-- the work runs. (PgBouncer's own idle_transaction_timeout, off by default, must stay above the
-- longest run: docs/guides/pgbouncer.md.)

-- name: try_lock
SELECT pg_try_advisory_xact_lock(hashtextextended(%(name)s, 0))
FROM (SELECT set_config('idle_in_transaction_session_timeout', '0', true)) AS holder;

-- name: lock_no_transaction_timeout
-- PostgreSQL 17's transaction_timeout would end the holder too: off, for its transaction only.
SELECT set_config('transaction_timeout', '0', true);

-- name: lock_holder
-- Who holds a lock a migrate waits for: said once, so a stuck migrate names its cause.
SELECT format('pid %%s (%%s, %%s for %%s)', a.pid, coalesce(nullif(a.application_name, ''), '?'),
              a.state, date_trunc('second', now() - coalesce(a.xact_start, a.backend_start)))
FROM pg_locks AS l
JOIN pg_stat_activity AS a USING (pid)
WHERE l.locktype = 'advisory' AND l.granted
  AND (l.classid::bigint << 32 | l.objid::bigint) = hashtextextended(%(name)s, 0)
LIMIT 1;

-- name: lock_alive
-- Between steps of the work: the holder's connection (and so the lock) is still there.
SELECT 1;
