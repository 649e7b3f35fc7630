"""Test helpers: service discovery, fakes, a TCP proxy, relay subprocesses and deadline waits."""
