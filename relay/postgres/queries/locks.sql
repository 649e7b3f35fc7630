-- The locks that keep one migrate, one pruner and one pipeline run at a time per schema
-- (relay/postgres/pg.py: `exclusive`). Transaction-scoped, taken in a transaction left open on a
-- connection of their own for as long as the work runs: through a transaction-mode pooler
-- (PgBouncer) a session-level lock would stay on whichever server connection took it and exclude
-- nothing. The keys are those of the session-level locks of earlier versions (the same text,
-- hashed alike), and the two kinds conflict: during a rolling upgrade old and new exclude each
-- other. Idle in a transaction with no xid and no snapshot, the holder does not hold back vacuum.

-- The holder also turns off, for its own transaction only, a server's
-- idle_in_transaction_session_timeout, which would otherwise end it (and the lock with it) while
-- the work runs. (PgBouncer's own idle_transaction_timeout, off by default, must stay above the
-- longest run: README, "Behind PgBouncer".)

-- name: wait_for_lock
SELECT pg_advisory_xact_lock(hashtextextended(%(name)s, 0))
FROM (SELECT set_config('idle_in_transaction_session_timeout', '0', true)) AS holder;

-- name: try_lock
SELECT pg_try_advisory_xact_lock(hashtextextended(%(name)s, 0))
FROM (SELECT set_config('idle_in_transaction_session_timeout', '0', true)) AS holder;
