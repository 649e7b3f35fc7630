"""`python -m relay` is `outbox-relay`."""

from relay.cli import main

main(prog_name="outbox-relay")
