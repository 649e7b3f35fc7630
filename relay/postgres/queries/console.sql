-- What the web console reads and records (relay/postgres/browse.py, actions.py), as the role its
-- login has: viewer (SELECT only) or operator. `{schema}` is replaced by the quoted, validated
-- schema name; nothing else is ever spliced in. The dead-letter page is put together from the
-- fragments named `dead_page_*`, each a fixed text: only the filters given are added, so that the
-- planner sees each filter's own index (a `(%(x)s IS NULL OR …)` form hides them).

-- name: console_session
-- Every read of the console is bounded in time; the page says so.
SET statement_timeout = '5s';

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
WITH sessions AS (
    SELECT substr(application_name, length('outbox-relay ') + 1) AS name,
           count(*) AS sessions, min(backend_start) AS since,
           max(greatest(state_change, query_start)) AS last_seen,
           string_agg(DISTINCT coalesce(host(client_addr), 'local'), ', ') AS hosts
    FROM pg_stat_activity
    WHERE datname = current_database() AND application_name LIKE 'outbox-relay %%'
      -- the sessions of operators' tools, which name what they do (relay/postgres/pg.py)
      AND application_name NOT IN ('outbox-relay admin', 'outbox-relay console',
                                   'outbox-relay pipeline', 'outbox-relay replay')
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
FROM sessions AS s FULL JOIN leases AS l ON l.name = s.name
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
-- Records a bulk action as running; a second one of the same selection is refused by
-- console_actions_running_idx (the caller shows the running one instead).
INSERT INTO {schema}.console_actions (kind, who, filter, selection, upto, matched)
VALUES (%(kind)s, %(who)s, %(filter)s, %(selection)s,
        (SELECT coalesce(max(id), 0) FROM {schema}.dead), %(matched)s)
RETURNING id, upto;

-- name: action_interrupt_stale
-- A running action whose console stopped beating: interrupted (its rows moved or not, each once).
UPDATE {schema}.console_actions
SET state = 'interrupted', finished_at = now(),
    detail = 'its console stopped before it finished'
WHERE selection = %(selection)s AND state = 'running'
  AND beat_at < now() - make_interval(secs => %(stale)s);

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
WHERE selection = %(selection)s
ORDER BY state = 'running' DESC, id DESC
LIMIT 1;

-- name: action_list
SELECT id, kind, who, db_user, filter, matched, done, state, detail, started_at, beat_at,
       finished_at
FROM {schema}.console_actions
ORDER BY id DESC
LIMIT %(limit)s;
