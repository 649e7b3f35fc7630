"""A Spark standalone cluster on this machine: a master and one worker, started with the installed
pyspark's own launcher (`bin/spark-class`), up once the worker has registered, and stopped with
every process it started (the executors included)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pyspark

from tests.support.wait import until

#: The pip-installed pyspark is a Spark distribution: bin/, jars/, and what the worker needs to
#: launch executors.
SPARK_HOME = Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class Cluster:
    url: str  # spark://127.0.0.1:PORT, the master
    ui: str  # the master's web UI, whose /json/ is its state
    work_dir: Path  # the worker's: a folder per application, and one per executor in it
    logs: Path  # the master's and the worker's own output

    def state(self) -> dict[str, Any]:
        """The master's view: workers, and the active and completed applications."""
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=5) as response:  # noqa: S310
            state: dict[str, Any] = json.load(response)
        return state

    def applications(self) -> dict[str, dict[str, Any]]:
        """Every application the master has seen, running or completed, by id."""
        state = self.state()
        return {app["id"]: app for app in state["activeapps"] + state["completedapps"]}


@contextlib.contextmanager
def standalone(folder: Path, env: Mapping[str, str], *, timeout: float = 90) -> Iterator[Cluster]:
    """A master and a worker with 1 core and 1 GB (room for one executor), on free ports of
    127.0.0.1; `env` is their environment (the executors inherit the worker's)."""
    env = {
        **env,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOCAL_IP": "127.0.0.1",  # every process binds and advertises 127.0.0.1
        # pyspark's own, which its wheel leaves out: none of the machine's spark-env.sh is read,
        # and the daemons' class path is the tests' other Spark JVMs' (tests/support/
        # spark_classes.py: then they share their class archive).
        "SPARK_CONF_DIR": str(SPARK_HOME / "conf"),
    }
    port, ui = free_port(), free_port()
    cluster = Cluster(
        f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui}", folder / "work", folder / "logs"
    )
    cluster.work_dir.mkdir(parents=True)
    cluster.logs.mkdir()
    started: list[subprocess.Popen[bytes]] = []
    try:
        master = ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui)]
        started.append(_launch(cluster.logs / "master", env, "master.Master", *master))
        worker = [
            cluster.url,
            *("--host", "127.0.0.1", "--cores", "1", "--memory", "1g"),
            *("--webui-port", str(free_port()), "--work-dir", str(cluster.work_dir)),
        ]
        started.append(_launch(cluster.logs / "worker", env, "worker.Worker", *worker))
        until(
            lambda: _registered(cluster, started),
            timeout=timeout,
            interval=0.2,
            message=f"the worker to register with the master (logs in {cluster.logs})",
        )
        yield cluster
    finally:
        for proc in reversed(started):
            stop(proc)


def _launch(log: Path, env: Mapping[str, str], role: str, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), f"org.apache.spark.deploy.{role}", *args],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own: the worker's executors join it
        )


def _registered(cluster: Cluster, started: list[subprocess.Popen[bytes]]) -> bool:
    for proc in started:
        if proc.poll() is not None:
            logs = "\n".join(p.read_text()[-3000:] for p in sorted(cluster.logs.iterdir()))
            raise AssertionError(f"a Spark daemon exited with {proc.returncode}:\n{logs}")
    try:
        state = cluster.state()
    except (OSError, urllib.error.URLError, ValueError):  # not listening yet, or half a page
        return False
    return any(w["state"] == "ALIVE" and w["cores"] >= 1 for w in state["workers"])


def stop(proc: subprocess.Popen[bytes], seconds: float = 15) -> None:
    """SIGTERM to the process's group (the worker stops its executors), SIGKILL to what is left
    after `seconds`; returns once no process of the group is alive."""
    group = proc.pid  # start_new_session: the group's id is the leader's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    try:
        proc.wait(seconds)
        until(lambda: not _members(group), timeout=seconds, interval=0.1, message="its group")
    except (subprocess.TimeoutExpired, AssertionError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
        proc.wait()
        until(lambda: not _members(group), timeout=seconds, interval=0.1, message="its group")


def _members(group: int) -> list[int]:
    """The live (not zombie) processes of a process group, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp …; comm may hold spaces and parentheses.
            fields = stat.read_text().rpartition(")")[2].split()
            if fields[0] != "Z" and int(fields[2]) == group:
                found.append(int(stat.parent.name))
    return found
