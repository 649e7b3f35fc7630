"""Everything that speaks to PostgreSQL (psycopg): the relay's store and listener, migrations and
roles, the producer's enqueue, the operators' Admin, the consumers' Inbox, and the SQL loader with
its `.sql` files."""
