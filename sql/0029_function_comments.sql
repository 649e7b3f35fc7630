-- 0029: every function a role may call says what it does (`\df+` in psql, and
-- docs/reference/sql.md, which is generated from these comments).
--
-- Upgrading: comments only. No lock a producer or a relay waits for beyond the catalog row each
-- COMMENT writes; relays of 0.1 and 0.2 and of the previous version keep working, and rolling
-- back one step needs nothing.

COMMENT ON FUNCTION start_replay(text, jsonb, boolean) IS
    'Start replay p_name with selection p_selection (or find it, if p_create): the replay''s recorded position and selection, for `outbox-relay pipeline replay`.';
COMMENT ON FUNCTION replay_batch(text, bigint, bigint[], text[], text[], bytea[], text[], jsonb[], text[], text[], uuid[]) IS
    'Enqueue one batch of replay p_name and move its position from p_after to the batch''s last lake id, in the caller''s transaction; refused if the position is no longer p_after (another run moved it). Returns how many were enqueued.';
COMMENT ON FUNCTION replay_skip(text, bigint, bigint, text, text) IS
    'Record that replay p_name skipped lake row p_id (the outbox refused it, for p_reason) and move its position past it.';
COMMENT ON FUNCTION claim(claim_request) IS
    'A relay''s claim: lease up to max_rows due rows (expired leases first) under a new claim id, counting an attempt, from the relay''s cursors; returns their ids and sizes (the rows are fetched after this commits).';
COMMENT ON FUNCTION settle(uuid, bigint[], text[], text[], text[], float8[], bigint[], boolean, claim_request) IS
    'A relay''s settle: archive, dead-letter, retry or release each row of claim p_claim_id that it still holds (fenced by the claim id), release the keys it frees, and with a request claim the next batch in the same transaction.';
COMMENT ON FUNCTION extend_leases(uuid, bigint[], float8) IS
    'Push the lease of the rows claim p_claim_id still holds by p_lease seconds; returns the ids it still holds (the others must not be published).';
COMMENT ON FUNCTION prune_archive(timestamptz, integer) IS
    'Delete the archive''s oldest p_batch rows (1 to 100,000) of those published before p_cutoff; returns how many went (gone) and how many of the oldest p_batch are younger (younger). The pruner and `outbox-relay archive prune` call it in short transactions.';
COMMENT ON FUNCTION arm_doorbell() IS
    'The doorbell (docs/decisions/0008): take SHARE on outbox.doorbell, waiting for every producer that did not notify, so that producers notify while this relay sleeps.';
COMMENT ON FUNCTION use_doorbell() IS
    'Turn the doorbell on for this schema (settings.doorbell): producers then notify only while a relay holds it.';
COMMENT ON FUNCTION dead_matches(dead, text[], text, text, text, timestamptz, timestamptz, uuid[]) IS
    'Whether dead letter d matches a filter (each NULL matches all): one of p_reasons, the exchange exactly, routing key and ordering key as LIKE patterns, failed at or after p_since and before p_until, one of p_ids (message ids). The dead-letter commands select with it.';
COMMENT ON FUNCTION replay_dead(bigint[], text, text) IS
    'Move the dead letters p_ids back into the outbox, each keeping its message_id and starting again at attempt 1, optionally to another exchange or routing key; returns the message ids moved.';
COMMENT ON FUNCTION release_key(text, boolean) IS
    'Release ordering key p_key, blocked behind its dead message: skip that message, or (p_replay) put it back first in its place; whether the key was blocked.';
COMMENT ON FUNCTION key_policy(text) IS
    'The policy (on_dead, concurrency, min_interval) that applies to ordering key p_key: the longest matching prefix, or the default.';
COMMENT ON FUNCTION forget_idle_keys(interval, text, integer) IS
    'Forget up to p_limit ordering keys after p_after (in key order) with nothing waiting, nothing dead and no use for p_idle_for (an hour or more); returns how many (forgotten) and the last key looked at (last_key), to go on from. A key used again is numbered from 1.';
