-- 0011: validate 0010's constraint. VALIDATE CONSTRAINT reads the table under a lock that lets
-- producers and relays go on writing, so a deep backlog delays only this migration. A row with an
-- infinite time written by an older enqueue while 0010 ran is made due at its creation first.
UPDATE messages SET available_at = created_at WHERE NOT isfinite(available_at);
ALTER TABLE messages VALIDATE CONSTRAINT messages_available_at_finite;
