-- What the web console reads and records (relay/postgres/browse.py, actions.py), as the role its
-- login has: viewer (SELECT only) or operator. `{schema}` is replaced by the quoted, validated
-- schema name; nothing else is ever spliced in. The dead-letter page is put together from the
-- fragments named `dead_page_*`, each a fixed text: only the filters given are added, so that the
-- planner sees each filter's own index (a `(%(x)s IS NULL OR …)` form hides them).

-- name: console_read_bound
-- Every read of the console runs in a transaction of its own, bounded in time (the page says so);
-- SET LOCAL, so that behind a transaction pooler the bound goes with the transaction.
SET LOCAL statement_timeout = '5s';

-- name: console_rights
-- What this login may do: its buttons follow it, and the server refuses what it may not.
SELECT has_function_privilege(
           format('%%I.replay_dead(bigint[], text, text)', %(schema)s::text), 'EXECUTE'),
       has_table_privilege(format('%%I.dead', %(schema)s::text), 'DELETE'),
       has_function_privilege(format('%%I.release_key(text, boolean)', %(schema)s::text), 'EXECUTE'),
       has_table_privilege(format('%%I.console_actions', %(schema)s::text), 'INSERT');

-- name: console_backlog
-- Waiting messages by exchange and state, counted over at most a million rows; the oldest wait.
SELECT exchange,
       count(*) FILTER (WHERE claim_id IS NULL AND NOT gated AND available_at <= now()) AS due,
       count(*) FILTER (WHERE claim_id IS NULL AND NOT gated AND available_at > now()) AS later,
       count(*) FILTER (WHERE gated) AS gated,
       count(*) FILTER (WHERE claim_id IS NOT NULL) AS leased,
       extract(epoch FROM now() - min(created_at)) AS oldest
FROM (SELECT exchange, claim_id, gated, available_at, created_at
      FROM {schema}.messages LIMIT 1000000) AS m
GROUP BY exchange
ORDER BY count(*) DESC, exchange
LIMIT 50;

-- name: console_rates
-- Messages published and dead-lettered in each of the last ten minutes.
SELECT minute,
       (SELECT count(*) FROM {schema}.archive AS a
        WHERE a.published_at >= minute AND a.published_at < minute + interval '1 minute'),
       (SELECT count(*) FROM {schema}.dead AS d
        WHERE d.failed_at >= minute AND d.failed_at < minute + interval '1 minute')
FROM generate_series(date_trunc('minute', now()) - interval '9 minutes',
                     date_trunc('minute', now()), interval '1 minute') AS minute
ORDER BY minute;

-- name: console_relays
-- The relays alive: their sessions (named `outbox-relay <name>`) on this database, and the
-- leases each holds. A relay's pool keeps a session open while it runs, idle or not.
-- A relay's session name is cut to PostgreSQL's 63 bytes (store.py): its first 50 characters.
-- Without pg_read_all_stats, another login's sessions show no address or start (NULL: "?").
WITH sessions AS (
    SELECT substr(application_name, length('outbox-relay ') + 1) AS name,
           count(*) AS sessions, min(backend_start) AS since,
           max(greatest(state_change, query_start)) AS last_seen,
           string_agg(DISTINCT host(client_addr), ', ') AS hosts
    FROM pg_stat_activity
    WHERE datname = current_database() AND application_name LIKE 'outbox-relay %%'
      -- the sessions of operators' tools, which name what they do (relay/postgres/pg.py)
      AND application_name NOT IN ('outbox-relay admin', 'outbox-relay console',
                                   'outbox-relay pipeline', 'outbox-relay replay',
                                   'outbox-relay doorbell')
      AND application_name NOT LIKE 'outbox-relay migrate%%'
      AND application_name NOT LIKE 'outbox-relay %% lock'
    GROUP BY 1
), leases AS (
    SELECT claimed_by AS name, count(*) AS leased, max(available_at) AS lease_end,
           max(claimed_at) AS last_claim
    FROM {schema}.messages
    WHERE claim_id IS NOT NULL AND claimed_by IS NOT NULL
    GROUP BY claimed_by
)
SELECT coalesce(s.name, l.name), s.sessions, s.since, s.last_seen, s.hosts,
       coalesce(l.leased, 0), l.lease_end, l.last_claim
FROM sessions AS s FULL JOIN leases AS l ON left(l.name, 50) = s.name
ORDER BY 1
LIMIT 100;

-- name: console_horizon
-- The vacuum horizon: who holds back the oldest snapshot, and the messages table's dead tuples.
SELECT (SELECT n_dead_tup FROM pg_stat_user_tables
        WHERE relid = to_regclass(format('%%I.messages', %(schema)s::text))),
       h.seconds, h.xids, h.pid, h.state, h.application_name
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT extract(epoch FROM now() - coalesce(xact_start, query_start)) AS seconds,
           age(backend_xmin) AS xids, pid, state, application_name
    FROM pg_stat_activity
    WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    ORDER BY age(backend_xmin) DESC
    LIMIT 1
) AS h ON true;

-- name: console_dead_by_reason
-- Dead letters by reason, each counted up to %(cap)s (an overview refreshes every few seconds:
-- it must not count a million rows each time), with the latest failure: the reason index.
SELECT r.reason,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.dead AS d WHERE d.reason = r.reason
                              LIMIT %(cap)s) AS s),
       (SELECT max(d.failed_at) FROM {schema}.dead AS d WHERE d.reason = r.reason)
FROM unnest(%(reasons)s::text[]) AS r(reason)
ORDER BY 2 DESC, 1;

-- name: dead_page_head
SELECT d.id, d.message_id, d.failed_at, d.reason, d.detail, d.exchange, d.routing_key,
       d.ordering_key, d.seq, d.attempts, d.replays, octet_length(d.body) AS size
FROM {schema}.dead AS d
WHERE true

-- name: dead_page_searched_head
-- A text search reads at most %(scan)s rows that match the other filters, newest first.
SELECT d.id, d.message_id, d.failed_at, d.reason, d.detail, d.exchange, d.routing_key,
       d.ordering_key, d.seq, d.attempts, d.replays, octet_length(d.body) AS size
FROM (SELECT * FROM {schema}.dead AS d
      WHERE true

-- name: dead_page_searched_tail
      ORDER BY d.failed_at DESC, d.id DESC
      LIMIT %(scan)s) AS d
WHERE (d.headers::text ILIKE %(text_like)s OR position(%(text_bytes)s IN d.body) > 0)

-- name: dead_page_reasons
AND d.reason = ANY(%(reasons)s::text[])

-- name: dead_page_exchange
AND d.exchange = %(exchange)s

-- name: dead_page_routing_key
AND d.routing_key LIKE %(routing_key)s ESCAPE '\'

-- name: dead_page_key
AND d.ordering_key LIKE %(key)s ESCAPE '\'

-- name: dead_page_since
AND d.failed_at >= %(since)s

-- name: dead_page_until
AND d.failed_at < %(until)s

-- name: dead_page_ids
AND d.message_id = ANY(%(ids)s::uuid[])

-- name: dead_page_id_range
AND d.message_id BETWEEN %(id_from)s AND %(id_to)s

-- name: dead_page_before
AND d.failed_at <= %(before_at)s AND (d.failed_at, d.id) < (%(before_at)s, %(before_id)s)

-- name: dead_page_upto
AND d.id <= %(upto)s

-- name: dead_page_window_end
-- Where a text search's window of %(scan)s rows ends: the next search starts after it.
ORDER BY d.failed_at DESC, d.id DESC
OFFSET %(scan)s - 1
LIMIT 1

-- name: dead_count_head
-- How many dead letters a bulk action would act on: the same fragments as a page.
SELECT count(*)
FROM {schema}.dead AS d
WHERE true

-- name: dead_window_head
SELECT d.failed_at, d.id
FROM {schema}.dead AS d
WHERE true

-- name: console_last_dead
SELECT coalesce(max(id), 0) FROM {schema}.dead;

-- name: dead_page_tail
ORDER BY d.failed_at DESC, d.id DESC
LIMIT %(limit)s

-- name: dead_by_id
SELECT message_id, failed_at, reason, detail, exchange, routing_key, ordering_key, seq, attempts,
       replays, created_at, ambiguous, replayed_at, replayed_from, headers, properties, body
FROM {schema}.dead
WHERE id = %(id)s;

-- name: message_whereabouts
-- Where a message id is now, if not dead: waiting (or in flight), or published.
SELECT 'waiting' AS place, created_at AS at, replays FROM {schema}.messages
WHERE message_id = %(message_id)s
UNION ALL
(SELECT 'published', published_at, 0 FROM {schema}.archive
 WHERE message_id = %(message_id)s ORDER BY id DESC LIMIT 1);

-- name: gated_keys
-- Keys with messages held back by the key gate (waiting for an earlier one), most held first.
SELECT ordering_key, count(*) AS held, min(seq) AS first_seq, min(created_at) AS oldest
FROM (SELECT ordering_key, seq, created_at FROM {schema}.messages WHERE gated
      LIMIT 100000) AS g
GROUP BY ordering_key
ORDER BY count(*) DESC, ordering_key
LIMIT 100;

-- name: action_start
-- Records a bulk action as running, acting on dead rows up to %(upto)s (what its confirm page
-- counted), and takes the action's advisory lock in this session, which runs it: the lock says
-- the action is alive. A second one of the same selection is refused by
-- console_actions_running_idx (the caller shows the running one instead).
INSERT INTO {schema}.console_actions (kind, who, filter, selection, upto, matched)
VALUES (%(kind)s, %(who)s, %(filter)s, %(selection)s, %(upto)s, %(matched)s)
RETURNING id,
          CASE WHEN %(lock)s
               THEN pg_try_advisory_lock(%(lock_class)s, (id %% 2147483647)::integer) END;

-- name: action_interrupt_stale
-- A running action of this selection whose runner is gone (no session holds its advisory lock)
-- and that has not moved for %(stale)s seconds: interrupted (each of its rows moved or not,
-- once). A slow batch keeps its lock, so a live action is never taken over.
UPDATE {schema}.console_actions AS a
SET state = 'interrupted', finished_at = now(),
    detail = 'its console stopped before it finished'
WHERE a.selection = %(selection)s AND a.state = 'running'
  AND a.beat_at < now() - make_interval(secs => %(stale)s)
  AND NOT EXISTS (SELECT 1 FROM pg_locks AS l
                  WHERE l.locktype = 'advisory' AND l.granted
                    AND l.classid::bigint = %(lock_class)s::bigint
                    AND l.objid::bigint = a.id %% 2147483647 AND l.objsubid = 2
                    AND l.database = (SELECT oid FROM pg_database
                                      WHERE datname = current_database()));

-- name: action_lock_wait
-- An action's statements wait this long for a lock (a producer's open transaction on a key it
-- replays), then its batch fails and the action ends 'failed': never an unbounded wait.
SELECT set_config('lock_timeout', %(wait)s, false);

-- name: action_progress
UPDATE {schema}.console_actions SET done = done + %(done)s, beat_at = now()
WHERE id = %(id)s AND state = 'running';

-- name: action_end
UPDATE {schema}.console_actions
SET state = %(state)s, detail = %(detail)s, finished_at = now(), beat_at = now()
WHERE id = %(id)s AND state = 'running';

-- name: action_get
SELECT id, kind, who, db_user, filter, matched, done, state, detail, started_at, beat_at,
       finished_at
FROM {schema}.console_actions
WHERE id = %(id)s;

-- name: action_latest
-- The latest actions of one selection (the running one first): what "already" refers to.
SELECT id, kind, who, db_user, filter, matched, done, state, detail, started_at, beat_at,
       finished_at
FROM {schema}.console_actions
WHERE selection = %(selection)s AND id <> %(exclude)s
ORDER BY state = 'running' DESC, id DESC
LIMIT 1;

-- name: action_list
SELECT id, kind, who, db_user, filter, matched, done, state, detail, started_at, beat_at,
       finished_at
FROM {schema}.console_actions
ORDER BY id DESC
LIMIT %(limit)s;
