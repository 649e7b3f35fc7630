-- 0001: the outbox tables: live messages, the archive of published ones, dead letters, and settings.
--
-- Migrations run with search_path set to the outbox schema (OUTBOX_SCHEMA), so no name here is
-- schema-qualified and the same files serve any schema name.

-- Limits the enqueue functions enforce. One row; change it with UPDATE.
CREATE TABLE settings (
    singleton        boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Largest body enqueue accepts. RabbitMQ's own limit (max_message_size) is 128 MiB; messages
    -- that large hurt every queue they pass through, so the default is far lower.
    max_body_bytes   integer NOT NULL DEFAULT 1048576 CHECK (max_body_bytes BETWEEN 0 AND 134217728),
    -- Largest headers object (as JSON text). AMQP carries headers in one content-header frame,
    -- which must fit in the connection's frame_max (RabbitMQ's default: 128 KiB).
    max_header_bytes integer NOT NULL DEFAULT 16384 CHECK (max_header_bytes BETWEEN 2 AND 65536)
);
INSERT INTO settings DEFAULT VALUES;

-- Messages waiting to be published, and those a relay is publishing now.
--
-- available_at is the one column the claim query filters on: the time the row may next be claimed.
-- It starts as the producer's available_at (or the enqueue time); a claim moves it to the end of the
-- lease, and a retry to the end of its back-off. A row whose lease expired is due again by
-- construction, so no sweeper has to find it. claim_id is the fencing token of the current lease.
CREATE TABLE messages (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   uuid        NOT NULL,
    exchange     text        NOT NULL CHECK (octet_length(exchange) <= 255),
    routing_key  text        NOT NULL CHECK (octet_length(routing_key) <= 255),
    body         bytea       NOT NULL,
    headers      jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(headers) = 'object'),
    properties   jsonb       NOT NULL DEFAULT '{}' CHECK (jsonb_typeof(properties) = 'object'),
    ordering_key text,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts     integer     NOT NULL DEFAULT 0,
    ambiguous    integer     NOT NULL DEFAULT 0,
    claim_id     uuid,
    claimed_by   text,
    claimed_at   timestamptz,
    last_error   text,
    CONSTRAINT messages_message_id_key UNIQUE (message_id)
);

-- The claim query reads the due rows in (available_at, id) order from this index.
CREATE INDEX messages_due_idx ON messages (available_at, id);

-- Published messages, kept for audit, replay and the data pipeline.
CREATE TABLE archive (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   uuid        NOT NULL,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    body         bytea       NOT NULL,
    headers      jsonb       NOT NULL,
    properties   jsonb       NOT NULL,
    ordering_key text,
    attempts     integer     NOT NULL,
    created_at   timestamptz NOT NULL,
    published_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX archive_message_id_idx ON archive (message_id);
-- Rows arrive in published_at order, so a BRIN index finds a time range at almost no write cost.
CREATE INDEX archive_published_at_idx ON archive USING brin (published_at);

-- Messages the relay gave up on, with the whole message so it can be replayed.
CREATE TABLE dead (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id   uuid        NOT NULL,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    body         bytea       NOT NULL,
    headers      jsonb       NOT NULL,
    properties   jsonb       NOT NULL,
    ordering_key text,
    attempts     integer     NOT NULL,
    reason       text        NOT NULL,
    detail       text        NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL,
    failed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX dead_message_id_idx ON dead (message_id);
CREATE INDEX dead_failed_at_idx ON dead (failed_at);
