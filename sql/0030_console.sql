-- 0030: the web console (`outbox-relay console`, docs/decisions/0011): its bulk actions are
-- recorded, and the dead-letter filters it offers are indexed.
--
-- console_actions: one row per bulk replay or purge, written by the console as the operator role
-- (who, when, the filter, how many matched, how many were done, how it ended). A replay removes
-- its rows from `dead`, so this record is what answers "already replayed". At most one action
-- per selection (kind + filter) runs at a time: a second operator who starts the same one is
-- refused by the unique index and shown the running one. An action whose console died stops
-- beating (`beat_at`); the next start of the same selection marks it interrupted and goes on,
-- which is safe because each batch moves a row once or not at all.
--
-- The indexes serve the console's first page of each filter, newest first, at 1,000,000 dead
-- rows: reason and exchange with the time order; routing and ordering keys by their prefix
-- (a glob's literal start, text_pattern_ops whatever the database's collation). A message id's
-- prefix is a range of dead_message_id_idx, and a time range is dead_failed_at_idx.
--
-- Upgrading: a new table and four indexes on `dead`. Building them holds dead's SHARE lock: a
-- relay that dead-letters a row meanwhile waits (bounded by its lock_timeout, then retried);
-- producers and every other relay statement never touch `dead`. Relays of 0.1, 0.2 and the
-- previous version keep working; rolling back one step needs nothing (the console is new).

CREATE TABLE console_actions (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind        text NOT NULL CHECK (kind IN ('replay', 'purge')),
    who         text NOT NULL CHECK (who <> '' AND length(who) <= 200),
    db_user     text NOT NULL DEFAULT session_user,
    filter      jsonb NOT NULL,
    selection   text NOT NULL,
    upto        bigint NOT NULL,
    matched     bigint NOT NULL CHECK (matched >= 0),
    done        bigint NOT NULL DEFAULT 0 CHECK (done >= 0),
    state       text NOT NULL DEFAULT 'running'
                CHECK (state IN ('running', 'finished', 'failed', 'interrupted')),
    detail      text NOT NULL DEFAULT '',
    started_at  timestamptz NOT NULL DEFAULT now(),
    beat_at     timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    CHECK ((state = 'running') = (finished_at IS NULL))
);
CREATE UNIQUE INDEX console_actions_running_idx ON console_actions (selection)
    WHERE state = 'running';
CREATE INDEX console_actions_selection_idx ON console_actions (selection, id);

CREATE INDEX dead_reason_idx ON dead (reason, failed_at);
CREATE INDEX dead_exchange_idx ON dead (exchange, failed_at);
CREATE INDEX dead_routing_key_idx ON dead (routing_key text_pattern_ops);
CREATE INDEX dead_ordering_key_prefix_idx ON dead (ordering_key text_pattern_ops)
    WHERE ordering_key IS NOT NULL;
