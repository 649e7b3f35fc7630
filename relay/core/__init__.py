"""The relay's core: the message model, the loop and its lease keeping, the ports it drives, and
the definitions everything else shares (settings, errors, log events). No database or broker
driver is imported here."""
