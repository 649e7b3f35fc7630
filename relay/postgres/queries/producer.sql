-- What producers run (relay/postgres/producer.py: relay.enqueue*), in their own transactions.
-- `{schema}` is replaced by the quoted, validated schema name and `{new_channel}` by the quoted
-- NOTIFY channel; nothing else is ever spliced into these texts.

-- name: enqueue
-- The casts pin the overload, so a missing function can only mean a missing migration. A delay is
-- added to the database's clock, not the producer's.
SELECT {schema}.enqueue(
    %(exchange)s::text, %(routing_key)s::text, %(body)s::bytea, %(headers)s::jsonb,
    %(properties)s::jsonb,
    coalesce(%(available_at)s::timestamptz, clock_timestamp() + %(delay)s::interval),
    %(ordering_key)s::text, %(message_id)s::uuid);

-- name: enqueue_many
-- Many messages in one round trip; delays (like enqueue's) are added to the database's clock.
SELECT id FROM {schema}.enqueue_many(
    %(exchanges)s::text[], %(routing_keys)s::text[], %(bodies)s::bytea[], %(headers)s::jsonb[],
    %(properties)s::jsonb[],
    ARRAY(SELECT coalesce(a, clock_timestamp() + d)
          FROM unnest(%(available_at)s::timestamptz[], %(delays)s::interval[])
               WITH ORDINALITY AS t(a, d, n)
          ORDER BY n),
    %(ordering_keys)s::text[], %(message_ids)s::uuid[]) AS id;
