-- 0003: separate unclaimed rows from leased ones, and keep a message's ambiguous sends on record.
--
-- A leased row whose lease ran out without a settle is an *orphan*: the relay publishing it died
-- (or lost the database for longer than its lease). The relays claim orphans one at a time, apart
-- from healthy rows, so that a row which kills whoever publishes it cannot take a whole batch down
-- with it. Two partial indexes make both claims cheap: unclaimed rows by due time, and the (few)
-- leased rows by lease expiry.
DROP INDEX messages_due_idx;
CREATE INDEX messages_due_idx ON messages (available_at, id) WHERE claim_id IS NULL;
CREATE INDEX messages_leased_idx ON messages (available_at, id) WHERE claim_id IS NOT NULL;

-- `attempts + ambiguous` bounds how many times a message can have been sent: the chaos suite
-- checks every duplicate a consumer saw against it.
ALTER TABLE archive ADD COLUMN ambiguous integer NOT NULL DEFAULT 0;
ALTER TABLE dead ADD COLUMN ambiguous integer NOT NULL DEFAULT 0;
