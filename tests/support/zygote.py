"""`outbox-relay` commands as real processes, forked from one that has already imported the CLI.

A command that runs to completion (`run_cli`) spends about 0.3 CPU-seconds importing the CLI,
pydantic and psycopg before it does anything, and the suite runs a few hundred of them. Each
worker starts one process (`python -m tests.support.zygote`) that imports them once and then,
for each command, forks a child. The child is a real process as the command line makes it: its
own environment (os.environ, so libpq sees it too), working directory, stdin, stdout and
stderr files, arguments, exit code, at-exit handlers; it starts from the state the imports left
and nothing a command did before (each child is a fresh fork). What it does not repeat is the
interpreter's start and the imports: a test of those starts its own process.

The protocol is a JSON line each way over the zygote's stdin and stdout: a request, then
`{"pid": …}` when the child is forked and `{"status": …}` when it has exited."""

from __future__ import annotations

import atexit
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

#: What every command imports first (relay/__main__.py, then the settings and the database).
PRELOAD = ("relay.cli.commands", "relay.core.config", "relay.postgres.admin")


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become the command, run it, and return its exit code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    stdin = os.open(request["stdin"] or os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), errors="backslashreplace", line_buffering=True
    )
    sys.argv = ["outbox-relay", *request["args"]]
    code = 0
    try:
        runpy.run_module("relay", run_name="__main__", alter_sys=True)
    except SystemExit as exiting:  # as the interpreter turns it into an exit code
        if exiting.code is None:
            code = 0
        elif isinstance(exiting.code, int):
            code = exiting.code
        else:
            print(exiting.code, file=sys.stderr)
            code = 1
    except BaseException:  # uncaught: the interpreter's traceback, and exit code 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def serve() -> None:
    """Read requests on stdin until it closes; fork a child for each, one at a time."""
    for module in PRELOAD:
        __import__(module)
    requests = os.fdopen(os.dup(0), "r")
    answers = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            code = 1
            try:
                code = _child(request)
            finally:
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


class Zygote:
    """The test process's side: one zygote, started on first use, one command at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._busy = threading.Lock()

    def run(
        self, args: list[str], env: Mapping[str, str], timeout: float, answer: str | None
    ) -> subprocess.CompletedProcess[str] | None:
        """Run `outbox-relay ARGS` in a forked child, as subprocess.run would; None when another
        thread's command is running (the caller then starts a process of its own)."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return self._run(args, env, timeout, answer)
        finally:
            self._busy.release()

    def busy(self) -> bool:
        """A command runs in the zygote now."""
        return self._busy.locked()

    def _started(self) -> tuple[IO[str], IO[str]]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(  # our own command line
                [sys.executable, "-m", "tests.support.zygote"],
                cwd=Path(__file__).resolve().parents[2],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            atexit.register(self._proc.communicate)  # its stdin closes: it ends
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        return self._proc.stdin, self._proc.stdout

    def _run(
        self, args: list[str], env: Mapping[str, str], timeout: float, answer: str | None
    ) -> subprocess.CompletedProcess[str]:
        requests, answers = self._started()
        with tempfile.TemporaryDirectory() as folder:
            paths = {name: str(Path(folder, name)) for name in ("in", "out", "err")}
            if answer is not None:
                Path(paths["in"]).write_text(answer)
            request = {
                "args": args,
                "env": dict(env),
                "cwd": os.getcwd(),
                "stdin": paths["in"] if answer is not None else None,
                "out": paths["out"],
                "err": paths["err"],
            }
            requests.write(json.dumps(request) + "\n")
            requests.flush()
            pid = json.loads(answers.readline())["pid"]
            timer = threading.Timer(timeout, os.kill, (pid, signal.SIGKILL))
            timer.start()
            try:
                code = json.loads(answers.readline())["status"]
            finally:
                timer.cancel()
            out, err = Path(paths["out"]).read_text(), Path(paths["err"]).read_text()
        command = [sys.executable, "-m", "relay", *args]
        if timer.finished.is_set() and code == -signal.SIGKILL:
            raise subprocess.TimeoutExpired(command, timeout, out, err)
        return subprocess.CompletedProcess(command, code, out, err)


if __name__ == "__main__":
    serve()
