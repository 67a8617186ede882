"""The Helm chart renders the same pod as the kustomize component.

Rendering uses Helm's own Go template engine through the ``helm-python-sdk``
package (PyPI; it bundles libhelm_c, so no helm binary is needed), or a ``helm``
binary on PATH. Without either, the render tests skip and the static checks
below still run.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.kvd_pod_checks import (
    DEPLOY,
    check_dashboard,
    check_kvd_pod,
    check_podmonitor,
    check_service,
)
from support.render_manifests import CHART, by_kind, helm_python, needs_renderer, render


@needs_renderer
def test_default_render_is_a_runnable_sidecar(tmp_path: Path) -> None:
    docs = render({})
    (deployment,) = by_kind(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    check_kvd_pod(deployment, configmaps, tmp_path)
    (service,) = by_kind(docs, "Service")
    check_service(service, deployment)
    (secret,) = by_kind(docs, "Secret")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"secretName": secret["metadata"]["name"], "defaultMode": 0o444} in [
        v.get("secret") for v in volumes
    ]
    assert not by_kind(docs, "PodMonitor")
    assert "checksum/config" in deployment["spec"]["template"]["metadata"]["annotations"]


@needs_renderer
def test_monitoring_render(tmp_path: Path) -> None:
    docs = render({"podMonitor": {"enabled": True}, "dashboard": {"enabled": True}})
    (deployment,) = by_kind(docs, "Deployment")
    (monitor,) = by_kind(docs, "PodMonitor")
    check_podmonitor(monitor, deployment)
    (dash,) = [d for d in by_kind(docs, "ConfigMap") if "kvd-dashboard.json" in d["data"]]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["data"]["kvd-dashboard.json"] == (DEPLOY / "grafana/kvd-dashboard.json").read_text()
    check_dashboard(dash["data"]["kvd-dashboard.json"])


@needs_renderer
def test_values_flow_into_config_and_ports(tmp_path: Path) -> None:
    docs = render(
        {
            "kvd": {"config": {"drain_timeout_s": 40.0, "lease_s": 12.5}},
            "terminationGracePeriodSeconds": 90,
            "auth": {"existingSecret": "my-token"},
        }
    )
    (deployment,) = by_kind(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    cfg = check_kvd_pod(deployment, configmaps, tmp_path)
    assert (cfg.drain_timeout_s, cfg.lease_s) == (40.0, 12.5)
    assert not by_kind(docs, "Secret")  # the operator's Secret is used as is


@needs_renderer
def test_grace_period_not_above_drain_timeout_refuses_to_render() -> None:
    with pytest.raises(Exception, match="drain_timeout_s"):
        render({"terminationGracePeriodSeconds": 30})


@pytest.mark.skipif(helm_python is None, reason="helm lint needs helm-python-sdk")
def test_helm_lint_has_no_errors() -> None:
    result = helm_python.lint(str(CHART))
    assert not result["errors"], result
    errors = [m for m in result["messages"] if m["severity"] >= 3]
    assert not errors, errors


# --- static checks: run even without a renderer ---------------------------------------


def _flatten(prefix: str, value: Any) -> set[str]:
    keys = {prefix} if prefix else set()
    if isinstance(value, dict):
        for k, v in value.items():
            keys |= _flatten(f"{prefix}.{k}" if prefix else k, v)
    return keys


def test_templates_reference_only_existing_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    known = _flatten("", values)
    for template in (CHART / "templates").iterdir():
        text = template.read_text()
        assert text.count("{{") == text.count("}}"), template.name
        for ref in re.findall(r"\.Values\.([A-Za-z0-9_.]+)", text):
            assert ref.rstrip(".") in known, f"{template.name}: .Values.{ref} not in values.yaml"


def test_chart_metadata_and_static_shape() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "kvd"
    import kvd

    assert chart["appVersion"] == kvd.__version__
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    from kvd.config import Config

    defaults = Config()
    assert values["kvd"]["ports"] == {
        "engine": 7100,
        "peer": 7101,
        "metrics": defaults.metrics_port,
    }
    assert values["terminationGracePeriodSeconds"] > values["kvd"]["config"]["drain_timeout_s"]
    assert "IPC_LOCK" in values["kvd"]["securityContext"]["capabilities"]["add"]
    deployment = (CHART / "templates/deployment.yaml").read_text()
    for needle in (
        "restartPolicy: Always",
        "path: /readyz",
        "path: /livez",
        "medium: Memory",
        "mountPath: /dev/shm",
        "fieldPath: status.podIP",
        'value: "tcp://$(POD_IP):{{ .Values.kvd.ports.peer }}"',
    ):
        assert needle in deployment, needle
    assert (CHART / "files/kvd-dashboard.json").read_text() == (
        DEPLOY / "grafana/kvd-dashboard.json"
    ).read_text()
