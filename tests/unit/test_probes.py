"""The relay's HTTP endpoint on a real socket: prometheus_client's exposition (gzip, OpenMetrics,
name[] filters) with the process's own metrics, and the two probes on the same port."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from relay.ops import metrics
from relay.ops.probes import Probes


@pytest.fixture
def base() -> Iterator[str]:
    counters = metrics.Metrics()
    counters.info.info({"version": "1", "relay_name": "pod-a", "schema": "outbox"})
    probes = Probes(counters.registry, lambda: (True, "ok"), lambda: (False, "broker: down"))
    port = probes.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        probes.stop()


def get(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)  # noqa: S310  # a local URL
    try:
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
            return int(response.status), dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), dict(exc.headers), exc.read()


def test_the_text_format_holds_the_relays_and_the_process_metrics(base: str) -> None:
    status, headers, body = get(base + "/metrics")
    text = body.decode()
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert 'outbox_relay_info{relay_name="pod-a",schema="outbox",version="1"} 1.0' in text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert f"\n{name} " in text, name
    assert "python_info{" in text


def test_gzip_when_the_scraper_asks_for_it(base: str) -> None:
    status, headers, body = get(base + "/metrics", **{"Accept-Encoding": "gzip"})
    assert status == 200
    assert headers["Content-Encoding"] == "gzip"
    assert b"outbox_claimed_total 0.0" in gzip.decompress(body)


def test_openmetrics_when_the_scraper_prefers_it(base: str) -> None:
    _, headers, body = get(base + "/metrics", Accept="application/openmetrics-text; version=1.0.0")
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_name_filters_return_only_the_metrics_asked_for(base: str) -> None:
    _, _, body = get(base + "/metrics?name[]=outbox_claimed_total&name[]=process_open_fds")
    names = {line.split()[0] for line in body.decode().splitlines() if not line.startswith("#")}
    assert names == {"outbox_claimed_total", "process_open_fds"}


def test_the_probes_share_the_port(base: str) -> None:
    assert get(base + "/livez")[0::2] == (200, b"ok\n")
    assert get(base + "/readyz")[0::2] == (503, b"broker: down\n")
    assert get(base + "/nothing")[0] == 404
