"""The `outbox-relay` command line: one module per command group (`commands` holds the group and the
relay's own commands)."""


def main() -> None:
    """The `outbox-relay` entry point (`relay.cli:main`, as it always was)."""
    from relay.cli.commands import main as outbox_relay

    outbox_relay()
