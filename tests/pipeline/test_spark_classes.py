"""The tests' Spark JVMs start from the class archive `deploy/dev test` makes (tests/support/
spark_classes.py): if a change to the class path or the JVM options stopped them using it, the
suite would silently lose its gain."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.support import spark_classes


def test_the_sessions_jvm_maps_the_class_archive(spark: SparkSession) -> None:
    if not spark_classes.ARCHIVE.is_file():
        if os.environ.get("CI"):  # deploy/dev makes it before the tests
            pytest.fail(f"no class archive at {spark_classes.ARCHIVE}")
        pytest.skip("no class archive: python -m tests.support.spark_classes makes one")
    chosen = os.environ.get("JAVA_TOOL_OPTIONS", "")
    if "-XX:SharedArchiveFile=" not in chosen and not os.environ.get("CI"):
        pytest.skip("this environment set JAVA_TOOL_OPTIONS itself, without the archive")
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    pid = jvm.java.lang.ProcessHandle.current().pid()
    mapped = Path(f"/proc/{pid}/maps").read_text()
    assert str(spark_classes.ARCHIVE) in mapped, (
        f"the session's JVM (pid {pid}) started without {spark_classes.ARCHIVE}: "
        f"JAVA_TOOL_OPTIONS={chosen!r}"
    )
