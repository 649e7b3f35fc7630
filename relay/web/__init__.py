"""The web console (`outbox-relay console`, the `[web]` extra): what waits, what died, which keys
are held, and bulk replay that is safe. Nothing outside it imports starlette or jinja2."""
