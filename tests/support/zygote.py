"""`outbox-relay` commands as real processes, forked from one that has already imported the CLI.

A command that runs to completion (`run_cli`) spends about 0.3 CPU-seconds importing the CLI,
pydantic and psycopg before it does anything, and the suite runs a few hundred of them. Each
worker starts one process (`python -m tests.support.zygote`) that imports them once and then,
for each command, forks a child. The child is a real process as the command line makes it: its
own environment (os.environ, so libpq sees it too), working directory, arguments, stdin, exit
code; stdout and stderr are pipes (named ones) the test reads to their end, so a process the
command leaves behind holding them keeps the test waiting, as `subprocess.run` would; at its
end it waits for its threads, runs its at-exit handlers and collects its garbage, as the
interpreter does. Each child starts from the state the imports left, never from another
command's. What it does not repeat is the interpreter's start: settings read only then
(PYTHONPATH, PYTHONHASHSEED, PYTHONUTF8, the locale) are the zygote's, which is this test
process's environment. A test of the start itself asks run_cli for a process of its own.

The protocol is a JSON line each way over the zygote's stdin and stdout: a request, then
`{"pid": …}` once the child is forked and `{"status": …, "timed_out": …}` once it has exited
(the zygote kills it at its timeout, before it has reaped it: the pid is still the child's)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import json
import os
import queue
import runpy
import select
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
#: How much longer than a command's own timeout the test waits for the zygote to answer.
GRACE = 30.0


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become the command, run it, end as the interpreter ends; its code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    stdin = os.open(request["stdin"] or os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY)
    err = os.open(request["err"], os.O_WRONLY)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        errors="backslashreplace",
        line_buffering=True,
        write_through=unbuffered,
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
    except KeyboardInterrupt:  # the interpreter ends by the signal itself
        code = -signal.SIGINT
    except BaseException:  # uncaught: the interpreter's traceback, and exit code 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    atexit._run_exitfuncs()
    gc.collect()  # what a finalizer would say at exit ("Task was destroyed …") is said
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _reaped(pid: int, timeout: float) -> tuple[int, bool]:
    """Wait for the child; at `timeout` SIGKILL it (not yet reaped: the pid is still its own)."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), not ready


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
            code = 1
            try:
                requests.close()
                answers.close()
                code = _child(request)
            except BaseException:  # before the command ran: say why where the test looks
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
                    sys.stderr.flush()
            finally:
                os._exit(code)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        code, timed_out = _reaped(pid, request["timeout"])
        answers.write(json.dumps({"status": code, "timed_out": timed_out}) + "\n")
        answers.flush()


class _Drained(threading.Thread):
    """Reads a named pipe to its end (when every writer has closed it)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.data = b""

    def run(self) -> None:
        with self.path.open("rb") as pipe:  # waits for the child to open it
            self.data = pipe.read()

    def release(self) -> None:
        """A child that never opened the pipe: open it once, so the reader's open returns."""
        if self.is_alive():
            with contextlib.suppress(OSError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))


class Zygote:
    """The test process's side: one zygote, started on first use, one command at a time."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._answers: queue.Queue[str] = queue.Queue()
        self._busy = threading.Lock()

    def busy(self) -> bool:
        """A command runs in the zygote now."""
        return self._busy.locked()

    def run(
        self, args: list[str], env: Mapping[str, str], timeout: float, answer: str | None
    ) -> subprocess.CompletedProcess[str] | None:
        """Run `outbox-relay ARGS` in a forked child, as subprocess.run would; None when the
        zygote cannot take it (another thread's command runs there, or it could not start):
        the caller then starts a process of its own."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return self._run(args, env, timeout, answer)
        finally:
            self._busy.release()

    def _started(self) -> IO[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(  # our own command line
                [sys.executable, "-c", "from tests.support.zygote import serve; serve()"],
                cwd=Path(__file__).resolve().parents[2],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its group holds its children: _abandon ends them all
            )
            self._answers = queue.Queue()
            threading.Thread(
                target=self._read, args=(self._proc.stdout, self._answers), daemon=True
            ).start()
            atexit.register(self._stop, self._proc)
        assert self._proc.stdin is not None
        return self._proc.stdin

    @staticmethod
    def _read(answers: IO[str], into: queue.Queue[str]) -> None:
        for line in answers:
            into.put(line)
        into.put("")  # it ended

    @staticmethod
    def _stop(proc: subprocess.Popen[str]) -> None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            proc.communicate(timeout=5)  # its stdin closes: it ends
        proc.kill()
        proc.wait()

    def _answer(self, seconds: float) -> dict[str, Any] | None:
        try:
            line = self._answers.get(timeout=seconds)
        except queue.Empty:
            return None
        return json.loads(line) if line else None

    def _run(
        self, args: list[str], env: Mapping[str, str], timeout: float, answer: str | None
    ) -> subprocess.CompletedProcess[str] | None:
        try:
            requests = self._started()
        except OSError:
            return None
        command = [sys.executable, "-m", "relay", *args]
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryDirectory() as folder:
            paths = {name: Path(folder, name) for name in ("in", "out", "err")}
            if answer is not None:
                paths["in"].write_text(answer)
            readers = []
            for name in ("out", "err"):
                os.mkfifo(paths[name], 0o600)
                readers.append(_Drained(paths[name]))
                readers[-1].start()
            request = {
                "args": args,
                "env": dict(env),
                "cwd": os.getcwd(),
                "stdin": str(paths["in"]) if answer is not None else None,
                "out": str(paths["out"]),
                "err": str(paths["err"]),
                "timeout": timeout,
            }
            ended: dict[str, Any] | None = None
            try:
                requests.write(json.dumps(request) + "\n")
                requests.flush()
                if self._answer(GRACE) is None:  # it could not start, or died
                    return None
                ended = self._answer(timeout + GRACE)
                if ended is None:
                    raise RuntimeError(f"the zygote stopped answering: {command}")
            except OSError:  # its stdin is closed: it died
                return None
            finally:
                if ended is None:  # interrupted (a test's timeout, Ctrl-C), stuck or dead
                    self._abandon()
                for reader in readers:
                    reader.release()
                    reader.join(max(0.0, deadline - time.monotonic()) if ended else GRACE)
            out, err = (reader.data.decode() for reader in readers)
            if ended["timed_out"] or any(reader.is_alive() for reader in readers):
                # At its timeout, or a process it left behind still holds its output open.
                raise subprocess.TimeoutExpired(command, timeout, out.encode(), err.encode())
        return subprocess.CompletedProcess(command, ended["status"], out, err)

    def _abandon(self) -> None:
        """Kill the zygote and the command it runs; the next call starts another."""
        if self._proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
            self._proc = None
