-- 0005: operations — vacuum settings for the queue table, dead letters visible from PostgreSQL's
-- own logs and LISTEN, and an index that lets the relay count gated rows without a table scan.

-- messages is a queue: every row is inserted, updated a few times (claim, heartbeat, settle) and
-- deleted, so it produces dead tuples at the rate messages flow while its live size stays small.
-- The default autovacuum trigger (50 rows + 20 % of the table) grows with the backlog: after a
-- backlog of a million rows it would wait for 200,000 dead tuples, bloating the indexes the
-- claim reads. A fixed threshold keeps vacuum running every few thousand changes whatever the
-- backlog, and without cost-based throttling, because the table is small and its pages are hot.
ALTER TABLE messages SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 2000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- Counting the rows held behind their key (a gauge) reads this index, not the table.
CREATE INDEX messages_gated_idx ON messages (ordering_key, seq) WHERE gated;

-- A dead-lettered message shows in PostgreSQL's log (a WARNING) and wakes anyone listening on
-- the `<schema>_dead` channel with a JSON payload (no body: message_id, reason, destination).
CREATE FUNCTION _dead_lettered() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    RAISE WARNING 'outbox: message % dead-lettered (%): %', NEW.message_id, NEW.reason, NEW.detail;
    PERFORM pg_notify(
        current_schema() || '_dead',
        json_build_object('message_id', NEW.message_id, 'reason', NEW.reason,
                          'exchange', NEW.exchange, 'routing_key', NEW.routing_key,
                          'ordering_key', NEW.ordering_key, 'attempts', NEW.attempts)::text
    );
    RETURN NULL;
END;
$$;

CREATE TRIGGER dead_lettered AFTER INSERT ON dead FOR EACH ROW EXECUTE FUNCTION _dead_lettered();
