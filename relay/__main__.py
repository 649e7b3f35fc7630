"""`python -m relay` is `outbox-relay`."""

from relay.cli.commands import main

main(prog_name="outbox-relay")
