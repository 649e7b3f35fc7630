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


def selectors(expr: str) -> Iterator[str]:
    """The metric names a PromQL expression reads (it raises if the expression does not parse)."""
    pending: list[Any] = [promql_parser.parse(expr)]
    while pending:
        node = pending.pop()
        if type(node).__name__ == "VectorSelector":
            yield node.name
        for attr in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if isinstance(child, list):
                pending.extend(child)
            elif child is not None and type(child).__module__.startswith("promql"):
                pending.append(child)


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


# Alert rules ------------------------------------------------------------------------------------

ALERTS = DEPLOY / "prometheus" / "alerts.yml"


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml_docs(ALERTS)[0]["groups"] for rule in group["rules"]]


def test_alert_rules_pass_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (deploy/dev test installs Debian's prometheus)")
    result = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


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


def test_every_dashboard_query_names_metrics_the_relay_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "outbox-relay.json").read_text(encoding="utf-8"))
    exported = exported_series()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    for expr in exprs:
        named = set(selectors(expr))
        assert named, expr
        assert named <= exported, f"{expr}: {named - exported}"


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


def test_the_operators_job_label_is_the_one_the_alerts_and_dashboard_use() -> None:
    """Under the Prometheus Operator the job label comes from the ServiceMonitor's jobLabel (else
    from the Service's name, outbox-relay-metrics, and the down alert fires forever)."""
    (monitor,) = yaml_docs(DEPLOY / "kubernetes" / "servicemonitor.yaml")
    labels = by_kind()["Service"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    job = labels[monitor["spec"]["jobLabel"]]
    alerts = (DEPLOY / "prometheus" / "alerts.yml").read_text(encoding="utf-8")
    dashboard = (DEPLOY / "grafana" / "outbox-relay.json").read_text(encoding="utf-8")
    named = set(re.findall(r'job=\\?"([^"\\]+)', alerts + dashboard))
    assert named == {job}


def test_a_timestamp_gauge_at_zero_is_never_shown_as_an_age() -> None:
    """`time() - gauge` of a gauge at 0 (autovacuum never ran) is 56 years: filter the zero out."""
    dashboard = (DEPLOY / "grafana" / "outbox-relay.json").read_text(encoding="utf-8")
    ages = re.findall(r'time\(\) - ([^"]*timestamp_seconds[^"]*)"', dashboard)
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
