"""`outbox-relay` as a real subprocess, with its output captured line by line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tests.support.zygote import Zygote

_ZYGOTE = Zygote()


def end(proc: subprocess.Popen[Any], seconds: float = 10.0) -> None:
    """SIGTERM; SIGKILL if it has not exited within `seconds`."""
    proc.terminate()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def clean_env(**settings: str) -> dict[str, str]:
    """The parent's environment without any OUTBOX_* setting, plus `settings`. Relays started by
    tests serve their metrics on any free port, so several can run side by side."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_METRICS_PORT"] = "0"
    env.update(settings)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    answer: str | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run `outbox-relay ARGS` to completion and capture its output; `answer` is its stdin
    (else it has none, as under CI). A child forked from this worker's zygote, which has the CLI
    imported already (tests/support/zygote.py); a process the interpreter starts, as a user's
    shell does, when `fresh` (for a test of that start) or while another thread's command runs
    in the zygote."""
    if not fresh:
        forked = _ZYGOTE.run(list(args), env or clean_env(), timeout, answer)
        if forked is not None:
            return forked
    return subprocess.run(
        [sys.executable, "-m", "relay", *args],
        env=dict(env or clean_env()),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        input=answer,
        stdin=None if answer is not None else subprocess.DEVNULL,
    )


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], code: int, *fragments: str
) -> None:
    """The command failed with `code` and one line on stderr that holds every fragment."""
    stderr = result.stderr
    assert result.returncode == code, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("outbox-relay: error: ")
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0]


class RelayProcess:
    """`outbox-relay run` in the background. `wait_for(text)` waits on its output, not on time.
    `launcher` goes before the command (e.g. a wrapper such as `opentelemetry-instrument`);
    `python` is the interpreter and its options (another venv's runs the release installed there,
    e.g. `[venv_python, "-I", "-u"]`: isolated from PYTHONPATH and the working directory, and
    unbuffered, as `-I` ignores PYTHONUNBUFFERED); `cwd` is where it runs (a folder holding
    another release's `relay` package runs that release)."""

    def __init__(
        self,
        env: Mapping[str, str],
        *args: str,
        launcher: Sequence[str] = (),
        python: Sequence[str] = (sys.executable,),
        cwd: str | None = None,
    ) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [*launcher, *python, "-m", "relay", "run", *args],
            env=dict(env),
            cwd=cwd,  # `-m relay` imports the package found here first (an older release's)
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float = 30.0) -> str:
        """The first output line containing `text`; AssertionError (with the output) on timeout
        or if the process exits first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"relay never printed {text!r}; output:\n{self.output}")
                self._changed.wait(min(remaining, 0.5))

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Wait until the relay has connected to both services and starts claiming."""
        return self.wait_for(" ready: schema=", timeout)

    def exited(self, timeout: float = 30.0) -> int:
        """The exit code of a relay that ends by itself (`--until-empty`). Sending it SIGTERM
        instead races its own exit: once its handlers are gone the signal kills it (-15)."""
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> RelayProcess:
        return self

    def __exit__(self, failed: type[BaseException] | None, *_: object) -> None:
        if self.proc.poll() is None:
            self.kill()
        self._reader.join(5)
        if failed is not None:  # pytest shows a failed test's captured output: the relay's too
            print(f"-- what the relay printed (pid {self.proc.pid}):\n{self.output}")
