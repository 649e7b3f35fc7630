"""deploy/ and docker-compose.yml hang together, without a cluster or a Docker engine: manifests
against the Kubernetes schemas, alert rules through promtool and a PromQL parser, every metric a
rule or panel names actually exported by the relay."""

from __future__ import annotations

import configparser
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import promql_parser
import pytest
import yaml

from relay.cli import commands as cli
from relay.core import config, values
from relay.ops import metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def exported_series() -> set[str]:
    """Every series name the relay can export (counters end in _total, histograms in _bucket…)."""
    names = {"up"}  # Prometheus's own, per scrape target
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_count", "_sum"],
        "gauge": [""],
        "info": ["_info"],
    }
    for family in metrics.Metrics().registry.collect():
        names.update(family.name + suffix for suffix in suffixes[family.type])
    return names


def vector_selectors(expr: str) -> Iterator[Any]:
    """Every series selector of a PromQL expression (it raises if the expression does not parse)."""
    pending: list[Any] = [promql_parser.parse(expr)]
    while pending:
        node = pending.pop()
        if type(node).__name__ == "VectorSelector":
            yield node
        for attr in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if isinstance(child, list):
                pending.extend(child)
            elif child is not None and type(child).__module__.startswith("promql"):
                pending.append(child)


def selectors(expr: str) -> Iterator[str]:
    """The metric names a PromQL expression reads."""
    for node in vector_selectors(expr):
        yield node.name


def matchers(selector: Any) -> dict[str, tuple[str, str]]:
    """A series selector's label matchers: label -> (operator, value); at most one per label."""
    ops = [(promql_parser.MatchOp.Equal, "="), (promql_parser.MatchOp.Re, "=~")]  # unhashable
    found = {
        m.name: (next((s for op, s in ops if m.op == op), str(m.op)), m.value)
        for m in selector.matchers.matchers
    }
    assert len(found) == len(selector.matchers.matchers), f"{selector}: a label matched twice"
    return found


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


# Alert rules ------------------------------------------------------------------------------------

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
#: The same alerts for the Prometheus Operator.
PROMETHEUS_RULE = DEPLOY / "kubernetes" / "prometheusrule.yaml"


def rule_groups(path: Path) -> list[dict[str, Any]]:
    """The rule groups of the plain rules file, or of the PrometheusRule's spec."""
    (doc,) = yaml_docs(path)
    groups = doc["spec"]["groups"] if doc.get("kind") == "PrometheusRule" else doc["groups"]
    assert isinstance(groups, list)
    return groups


def rules(path: Path = ALERTS) -> list[dict[str, Any]]:
    return [rule for group in rule_groups(path) for rule in group["rules"]]


@pytest.mark.parametrize("source", [ALERTS, PROMETHEUS_RULE], ids=lambda p: p.name)
def test_alert_rules_pass_promtool(source: Path, tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (deploy/dev test installs Debian's prometheus)")
    rules_file = tmp_path / "rules.yml"  # promtool reads a rules file, not a PrometheusRule
    rules_file.write_text(yaml.safe_dump({"groups": rule_groups(source)}), encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_prometheus_rule_holds_exactly_the_rules_files_alerts() -> None:
    """Two copies of the alerts, one for a Prometheus that reads rules files and one for the
    Operator: they must not drift (the PrometheusRule's header says how to regenerate it)."""
    (resource,) = yaml_docs(PROMETHEUS_RULE)
    assert resource["apiVersion"] == "monitoring.coreos.com/v1"
    assert resource["kind"] == "PrometheusRule"
    assert resource["metadata"]["name"] == "outbox-relay"
    assert set(resource) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(resource["spec"]) == {"groups"}
    assert rule_groups(PROMETHEUS_RULE) == rule_groups(ALERTS)


def test_alert_rules_cover_the_operator_questions_each_with_a_runbook() -> None:
    exported = exported_series()
    names = set()
    for rule in rules():
        names.add(rule["alert"])
        assert set(selectors(rule["expr"])) <= exported, rule["alert"]
        assert rule["annotations"]["runbook"].strip()
        assert rule["annotations"]["summary"].strip()
        assert rule["labels"]["severity"] in {"warning", "critical"}
    assert {
        "OutboxRelayDown",
        "OutboxNotPublishing",
        "OutboxOldestMessageTooOld",
        "OutboxDeadLettersRising",
        "OutboxVacuumHorizonPinned",
        "OutboxAutovacuumOff",
        "OutboxBrokerBlocked",
    } <= names


def test_compose_prometheus_config_parses() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    config_file = DEPLOY / "prometheus" / "prometheus.yml"
    result = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(config_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# Grafana ----------------------------------------------------------------------------------------


DASHBOARD = DEPLOY / "grafana" / "outbox-relay.json"
#: The dashboard's query variables, each offering the values its predecessors leave.
SCOPE = ("namespace", "job", "instance")


def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def panel_exprs() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p["targets"]]


def test_every_dashboard_query_names_metrics_the_relay_exports() -> None:
    exported = exported_series()
    exprs = panel_exprs()
    assert len(exprs) >= 15
    for expr in exprs:
        named = set(selectors(expr))
        assert named, expr
        assert named <= exported, f"{expr}: {named - exported}"


def test_every_metric_the_relay_exports_has_a_panel() -> None:
    """An operator finds every figure the relay exports on the dashboard (the info metric is
    what its variables list), and the process's memory and CPU beside them."""
    shown = {name for expr in panel_exprs() for name in selectors(expr)}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total"} <= shown
    for family in metrics.Metrics().registry.collect():
        if family.type == "info" or not family.name.startswith("outbox_"):
            continue
        assert any(name.startswith(family.name) for name in shown), family.name


def test_the_dashboard_is_importable() -> None:
    """What Grafana needs to import it as is: the schema version it was written for, one id per
    panel, and panels that do not overlap on the 24-column grid."""
    board = dashboard()
    assert board["schemaVersion"] == 39
    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["w"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in taken, f"{panel['title']} overlaps {taken[x, y]}"
                taken[x, y] = panel["title"]


def test_the_dashboard_picks_namespace_job_and_instance_from_chained_variables() -> None:
    """Each variable lists the values of outbox_relay_info (set at start-up, so exported by every
    relay) left by the ones before it; any number of them, or All. All of namespace is `.*`, which
    also matches series without the label (docker-compose's scrape adds none)."""
    variables = [v for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    assert [v["name"] for v in variables] == list(SCOPE)
    assert "outbox_relay_info" in exported_series()
    for before, variable in enumerate(variables):
        assert variable["multi"] is True, variable["name"]
        assert variable["includeAll"] is True, variable["name"]
        assert variable["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert variable["definition"] == variable["query"]
        found = re.fullmatch(
            r"label_values\((outbox_relay_info(?:\{.*\})?), (\w+)\)", variable["query"]
        )
        assert found, variable["query"]
        (selector,) = vector_selectors(found[1])
        assert found[2] == variable["name"]
        assert matchers(selector) == {n: ("=~", f"${n}") for n in SCOPE[:before]}
    assert variables[0]["allValue"] == ".*"


def test_every_dashboard_query_is_scoped_by_the_variables() -> None:
    """Every series a panel reads (up included) is narrowed by all three variables, and nothing
    names a job of its own: the job is whatever the scrape calls it, picked with $job."""
    scope = {n: ("=~", f"${n}") for n in SCOPE}
    for expr in panel_exprs():
        for selector in vector_selectors(expr):
            found = matchers(selector)
            assert found.items() >= scope.items(), expr


def unit_of(expr: str) -> str:
    """The Grafana unit a query's values are in. By the Prometheus naming rule a metric's name
    ends in its base unit, so a `_seconds` gauge, a quantile of a `_seconds` histogram and
    `time() - …_timestamp_seconds` are seconds ("s"), a rate() of a `_seconds_total` counter a
    share of a core ("percentunit"), a `_bytes` gauge bytes; any other rate() is events per second
    ("ops"); the rest (gauges, up, increase() over a window, quantiles of a histogram of rows) are
    counts ("short")."""
    names = set(selectors(expr))
    if "rate(" in expr and any(name.endswith("_seconds_total") for name in names):
        return "percentunit"  # seconds per second: the share of a core a process spends
    if any(name.endswith(("_seconds", "_seconds_bucket", "_seconds_sum")) for name in names):
        return "s"
    if any(name.endswith("_bytes") for name in names):
        return "bytes"
    if "rate(" in expr and not expr.startswith("histogram_quantile("):
        return "ops"
    return "short"


def test_no_dashboard_panel_mixes_units_on_one_axis() -> None:
    """Seconds beside a count on one axis flatten one of them (and one unit labels both)."""
    for panel in dashboard()["panels"]:
        units = {unit_of(t["expr"]) for t in panel["targets"]}
        assert units == {panel["fieldConfig"]["defaults"]["unit"]}, panel["title"]
        assert "unit" not in json.dumps(panel["fieldConfig"]["overrides"]), panel["title"]


# Kubernetes -------------------------------------------------------------------------------------

MANIFESTS = DEPLOY / "kubernetes" / "outbox-relay.yaml"


def by_kind() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml_docs(MANIFESTS)}


PIPELINE = DEPLOY / "kubernetes" / "pipeline-cronjob.yaml"
SECRETS = DEPLOY / "kubernetes" / "secrets.example.yaml"


def test_manifests_match_the_kubernetes_schemas() -> None:
    for doc in [*yaml_docs(MANIFESTS), *yaml_docs(PIPELINE), *yaml_docs(SECRETS)]:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    (monitor,) = yaml_docs(DEPLOY / "kubernetes" / "servicemonitor.yaml")  # a CRD: no schema
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


@pytest.mark.parametrize("source", [ALERTS, PROMETHEUS_RULE], ids=lambda p: p.name)
def test_the_operators_job_label_is_the_one_the_alerts_use(source: Path) -> None:
    """Under the Prometheus Operator the job label comes from the ServiceMonitor's jobLabel (else
    from the Service's name, outbox-relay-metrics, and the down alert fires forever). The
    dashboard names no job (its $job lists the jobs found)."""
    (monitor,) = yaml_docs(DEPLOY / "kubernetes" / "servicemonitor.yaml")
    labels = by_kind()["Service"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    job = labels[monitor["spec"]["jobLabel"]]
    named = {
        matchers(selector)["job"]
        for rule in rules(source)
        for selector in vector_selectors(rule["expr"])
        if "job" in matchers(selector)
    }
    assert named == {("=", job)}


def test_a_timestamp_gauge_at_zero_is_never_shown_as_an_age() -> None:
    """`time() - gauge` of a gauge at 0 (autovacuum never ran) is 56 years: filter the zero out."""
    ages = [
        age for e in panel_exprs() for age in re.findall(r"time\(\) - (.*timestamp_seconds.*)", e)
    ]
    assert ages
    assert all(age.rstrip(")").endswith("> 0") for age in ages), ages


def pods() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template in the manifests, by the kind that owns it."""
    docs = [*yaml_docs(MANIFESTS), *yaml_docs(PIPELINE)]
    found = [
        (d["kind"], d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in {"Job", "Deployment"}
    ]
    found += [
        (d["kind"], d["spec"]["jobTemplate"]["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] == "CronJob"
    ]
    return found


@pytest.mark.parametrize("kind", ["Deployment", "Job", "CronJob"])
def test_every_pod_meets_the_restricted_pod_security_standard(kind: str) -> None:
    (pod,) = [p for k, p in pods() if k == kind]
    assert pod["automountServiceAccountToken"] is False
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["seccompProfile"]["type"] == "RuntimeDefault"
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, container["name"]
        assert context["capabilities"]["drop"] == ["ALL"], container["name"]


def test_the_disruption_budget_never_blocks_a_drain_during_an_outage() -> None:
    budget = by_kind()["PodDisruptionBudget"]["spec"]
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_the_file_re_applied_on_upgrades_holds_no_secret() -> None:
    kinds = {doc["kind"] for doc in yaml_docs(MANIFESTS)}
    assert "Secret" not in kinds
    assert {doc["kind"] for doc in yaml_docs(SECRETS)} == {"Secret"}
    job = by_kind()["Job"]["metadata"]["name"]
    (container,) = by_kind()["Deployment"]["spec"]["template"]["spec"]["containers"]
    version = container["image"].rpartition(":")[2]
    assert job.endswith(version.replace(".", "-"))  # a new release's Job is a new Job


def test_deployment_is_wired_for_probes_scraping_and_graceful_stops() -> None:
    docs = by_kind()
    deployment = docs["Deployment"]["spec"]
    assert deployment["replicas"] >= 2
    pod = deployment["template"]
    (container,) = pod["spec"]["containers"]
    assert container["args"] == ["run"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["resources"]["requests"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9464"
    settings = docs["ConfigMap"]["data"]
    known = {config.env_name(f) for f in config.Settings.model_fields}
    assert set(settings) <= known
    assert not {"OUTBOX_DATABASE_URL", "OUTBOX_AMQP_URL"} & set(settings)  # secrets stay secret
    grace = values.parse_duration(settings["OUTBOX_SHUTDOWN_TIMEOUT"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > grace
    job = docs["Job"]["spec"]["template"]["spec"]
    assert [c["args"] for c in [*job["initContainers"], *job["containers"]]] == [
        ["migrate"],
        ["roles"],
    ]
    assert docs["PodDisruptionBudget"]["spec"]["minAvailable"] >= 1


def secret_files() -> dict[str, dict[str, str]]:
    """For each container (by name) of every pod in the manifests: the OUTBOX_*_FILE variables
    it sets, resolved to the Secret value the mounted file would hold."""
    docs = [*yaml_docs(MANIFESTS), *yaml_docs(PIPELINE), *yaml_docs(SECRETS)]
    secrets = {d["metadata"]["name"]: d["stringData"] for d in docs if d["kind"] == "Secret"}
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in {"Job", "Deployment"}]
    pods += [
        d["spec"]["jobTemplate"]["spec"]["template"]["spec"] for d in docs if d["kind"] == "CronJob"
    ]
    found: dict[str, dict[str, str]] = {}
    for pod in pods:
        volumes = {v["name"]: v["secret"] for v in pod.get("volumes", []) if "secret" in v}
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            assert "secretKeyRef" not in str(container.get("env")), "a URL in the environment"
            assert "secretRef" not in str(container.get("envFrom")), "a URL in the environment"
            mounts = {
                m["mountPath"]: secrets[volumes[m["name"]]["secretName"]]
                for m in container.get("volumeMounts", [])
                if m["name"] in volumes
            }
            files = {}
            for variable in container.get("env", []):
                if variable["name"].endswith("_URL_FILE"):
                    folder, _, key = variable["value"].rpartition("/")
                    assert key in mounts.get(folder, {}), f"{variable} names no mounted key"
                    files[variable["name"]] = mounts[folder][key]
            found[container["name"]] = files
    for volume in [v for pod in pods for v in pod.get("volumes", []) if "secret" in v]:
        assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    return found


def test_urls_reach_each_container_as_files_from_the_right_secret() -> None:
    files = secret_files()
    owner = files["migrate"]["OUTBOX_DATABASE_URL_FILE"]
    assert files["roles"] == {"OUTBOX_DATABASE_URL_FILE": owner}
    assert files["pipeline"] == {"OUTBOX_DATABASE_URL_FILE": owner}
    relay_urls = files["relay"]
    assert set(relay_urls) == {"OUTBOX_DATABASE_URL_FILE", "OUTBOX_AMQP_URL_FILE"}
    # The relays log in as a user of their own (granted outbox_relay), not as the owner.
    assert urlsplit(relay_urls["OUTBOX_DATABASE_URL_FILE"]).username != urlsplit(owner).username
    assert urlsplit(relay_urls["OUTBOX_AMQP_URL_FILE"]).scheme == "amqps"


def test_the_pipeline_cronjob_runs_the_pipeline_with_known_settings() -> None:
    cron = next(d for d in yaml_docs(PIPELINE) if d["kind"] == "CronJob")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    (container,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert container["args"][0] == "all"
    known = {config.env_name(f) for f in config.PipelineSettings.model_fields}
    known |= {f"{config.env_name(f)}_FILE" for f in config.SECRETS}
    assert {e["name"] for e in container["env"]} <= known
    dockerfile = (DEPLOY / "docker" / "Dockerfile.pipeline").read_text(encoding="utf-8")
    assert "libpostgresql-jdbc-java" in dockerfile
    assert '[spark]"' in dockerfile


# docker-compose and systemd ---------------------------------------------------------------------


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def test_compose_services_reference_what_exists() -> None:
    services = compose()["services"]
    assert {"postgres", "rabbitmq", "migrate", "relay", "prometheus", "grafana"} <= set(services)
    known_settings = {config.env_name(f) for f in config.Settings.model_fields}
    commands = set(cli.main.commands)
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        for volume in service.get("volumes", []):
            assert (ROOT / volume.split(":")[0]).exists(), volume
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
            assert service["command"][0] in commands
            assert set(service["environment"]) <= known_settings


def test_compose_publishes_every_port_on_loopback_only() -> None:
    """Grafana lets anonymous viewers in, and the servers have well-known passwords: nothing of
    the compose file may listen beyond this machine."""
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_the_image_carries_the_licence() -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert "COPY pyproject.toml README.md LICENSE ./" in dockerfile  # into the wheel's dist-info
    assert "COPY LICENSE /usr/share/doc/outbox-relay/LICENSE" in dockerfile


def test_hosts_run_one_install_as_one_user_that_the_unit_says_how_to_create() -> None:
    unit = (DEPLOY / "systemd" / "outbox-relay.service").read_text(encoding="utf-8")
    assert "User=outbox-relay" in unit
    assert "#   useradd --system --no-create-home --shell /usr/sbin/nologin outbox-relay" in unit
    assert "ExecStart=/opt/outbox-relay/bin/outbox-relay run" in unit
    for cron in sorted((DEPLOY / "cron").iterdir()):
        line = next(x for x in cron.read_text(encoding="utf-8").splitlines() if x[:1].isdigit())
        fields = line.split(None, 6)
        assert fields[5] == "outbox-relay", f"{cron.name} runs as {fields[5]}"
        assert "/opt/outbox-relay/bin/outbox-relay " in fields[6], cron.name


def test_relay_replicas_wait_for_migrations() -> None:
    relay = compose()["services"]["relay"]
    assert relay["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert relay["deploy"]["replicas"] >= 2


def test_systemd_unit() -> None:
    unit_file = DEPLOY / "systemd" / "outbox-relay.service"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(unit_file.read_text(encoding="utf-8"))
    assert unit["Service"]["ExecStart"].endswith("outbox-relay run")
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    assert unit["Service"]["User"] != "root"
    lines = set(unit_file.read_text(encoding="utf-8").splitlines())
    hardening = {
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectKernelModules=yes",
        "RestrictNamespaces=yes",
        "SystemCallFilter=@system-service",
        "CapabilityBoundingSet=",
    }
    assert hardening <= lines
    # The URLs (passwords) come as credentials, not from a file the relay's user could read.
    assert "Environment=OUTBOX_DATABASE_URL_FILE=%d/database-url" in lines
    assert "LoadCredential=database-url:/etc/outbox-relay/database-url" in lines
    assert "#   install -m 0600 -o root -g root relay.env /etc/outbox-relay/relay.env" in lines
    analyze = shutil.which("systemd-analyze")
    if analyze:
        result = subprocess.run(
            [analyze, "verify", str(unit_file)], capture_output=True, text=True, check=False
        )
        problems = [
            line
            for line in (result.stdout + result.stderr).splitlines()
            if line.strip() and "is not executable" not in line
        ]
        assert problems == []


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "deploy/dev test     #" in readme
    assert ci.strip().splitlines()[-1] == "exec deploy/dev test"


CONSOLE = DEPLOY / "kubernetes" / "console.yaml"


def test_the_console_manifest_is_valid_private_and_asks_for_a_login() -> None:
    docs = yaml_docs(CONSOLE)
    for doc in docs:
        kubernetes_validate.validate(doc, "1.30.0", strict=True)
    kinds = {doc["kind"]: doc for doc in docs}
    assert set(kinds) == {"Deployment", "Service"}  # no Secret in a file re-applied on upgrades
    assert kinds["Service"]["spec"]["type"] == "ClusterIP"  # never exposed by itself
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    relay_pod = next(p for k, p in pods() if k == "Deployment")
    assert pod["securityContext"] == relay_pod["securityContext"]
    assert pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["securityContext"] == relay_pod["containers"][0]["securityContext"]
    args = container["args"]
    assert args[:3] == ["console", "--host", "0.0.0.0"]
    users = args[args.index("--users-file") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert users.rpartition("/")[0] in mounts
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"  # answers without a login
    secrets = {d["metadata"]["name"] for d in yaml_docs(SECRETS) if d["kind"] == "Secret"}
    named = {v["secret"]["secretName"] for v in pod["volumes"]}
    assert "outbox-relay-console" in secrets
    assert named - secrets == {"outbox-relay-console-users"}  # made from a users file (header)
    for volume in pod["volumes"]:
        assert volume["secret"]["defaultMode"] & 0o007 == 0
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text(encoding="utf-8")
    assert '[web]"' in dockerfile  # the image can run the console
