-- 0027: the ready lane of 0015 goes (docs/decisions/0004: one lane). What it still holds moves
-- into `messages`: a row no relay claimed is due (at its enqueue time, so it keeps its place), a
-- row under a claim keeps its claim and lease (its relay's settle no longer exists: the lease
-- runs out and another relay claims it again, as after a crash). A row whose message_id is
-- already waiting in `messages` (two enqueues of one id that the lane let through) goes to `dead`
-- with its reason rather than being published twice.
--
-- Upgrading: 0026 stopped producers writing to the lane; this migration waits (within
-- migrate's lock timeout, then tries again) for every transaction that wrote to it to end, and
-- holds the lane's tables, and `settings` for the columns it drops, for the moment it runs.

LOCK TABLE ready, claims, done IN ACCESS EXCLUSIVE MODE;

CREATE TEMP TABLE lane_rows ON COMMIT DROP AS
SELECT r.id, r.message_id, r.exchange, r.routing_key, r.body, r.headers, r.properties,
       r.created_at, c.claim_id, c.claimed_by, c.claimed_at, c.until, coalesce(c.resent, 0) AS resent
FROM ready r
LEFT JOIN claims c ON c.seg = r.seg AND c.id = r.id
WHERE NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = r.seg AND d.id = r.id);

INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties, attempts,
                  ambiguous, created_at, reason, detail)
SELECT l.message_id, l.exchange, l.routing_key, l.body, l.headers, l.properties,
       (l.claim_id IS NOT NULL)::integer, l.resent, l.created_at, 'rejected',
       'a second message with this message_id was waiting in the ready lane (migration 0027)'
FROM lane_rows l
WHERE EXISTS (SELECT 1 FROM messages m WHERE m.message_id = l.message_id);

INSERT INTO messages (id, message_id, exchange, routing_key, body, headers, properties,
                      created_at, available_at, attempts, ambiguous, claim_id, claimed_by,
                      claimed_at)
OVERRIDING SYSTEM VALUE
SELECT l.id, l.message_id, l.exchange, l.routing_key, l.body, l.headers, l.properties,
       l.created_at, coalesce(l.until, l.created_at), (l.claim_id IS NOT NULL)::integer,
       l.resent, l.claim_id, l.claimed_by, l.claimed_at
FROM lane_rows l
WHERE NOT EXISTS (SELECT 1 FROM messages m WHERE m.message_id = l.message_id);

DROP VIEW waiting;
DROP FUNCTION claim_batch(integer, bigint, uuid, text, float8, text, text, xid8, bigint, boolean,
                          boolean);
DROP FUNCTION settle_then_claim(uuid, bigint[], bigint[], text[], text[], bigint[], float8[],
                                text[], boolean[], boolean[], bigint[], boolean, integer, bigint,
                                uuid, text, float8, text, text, xid8, bigint, boolean, boolean);
DROP FUNCTION _settle(uuid, bigint[], bigint[], text[], text[], bigint[], float8[], text[],
                      boolean[], boolean[], bigint[], boolean, uuid, text, float8, integer, bigint);
DROP FUNCTION _keys_settled(text[], bigint[], text[], uuid[], uuid, text, float8, integer, bigint);
DROP FUNCTION _slow_claim(integer, bigint, uuid, text, float8);
DROP FUNCTION _ready_page(xid8[], xid8, xid8, pg_snapshot, xid8, bigint, integer, bigint, uuid,
                          text, float8);
DROP FUNCTION _ready_copy(bigint[], bigint[], float8[], text[], boolean[], boolean[], uuid);
DROP FUNCTION _ready_end(bigint[]);
DROP FUNCTION _ready_has(uuid);
DROP FUNCTION _held(uuid, bigint[]);
DROP FUNCTION _claimed_bytes(uuid, float8, bigint[]);
DROP FUNCTION _stragglers(pg_snapshot, integer);
DROP FUNCTION _window_first_open(pg_snapshot, pg_snapshot);
DROP FUNCTION _segment_open_since(integer, pg_snapshot);
DROP FUNCTION sweep_stragglers(text, integer);
DROP FUNCTION lane_start();
DROP FUNCTION release_orphans(timestamptz, integer);
DROP FUNCTION reclaim_segment(integer);
DROP FUNCTION lane_gauges();
DROP FUNCTION use_fast_lane();
DROP FUNCTION set_fast_lane(boolean);
DROP TABLE ready, claims, done;
DROP FUNCTION _seg(bigint);
ALTER TABLE settings DROP COLUMN fast_lane, DROP COLUMN fast_lane_off;
