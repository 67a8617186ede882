"""Kubernetes manifests: every file parses, and the kustomize base rendered with the
kvd-sidecar component yields a pod that kvd can actually run in.

No kustomize binary can be installed from the package registries here, so
``render_kustomization`` implements the subset of kustomize these manifests use
(resources, components, patches with kind/labelSelector targets as strategic
merge, secretGenerator, labels, images) and refuses any other key, so a manifest
change that needs real kustomize features fails here instead of passing untested.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.kvd_pod_checks import (
    DEPLOY,
    check_dashboard,
    check_kvd_pod,
    check_podmonitor,
    check_service,
    load_docs,
)
from support.render_manifests import K8S, by_kind, render_kustomization, strategic_merge

ALL_MANIFESTS = sorted(p for p in K8S.rglob("*.yaml"))


@pytest.mark.parametrize("path", ALL_MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_parses_with_required_fields(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), path
        if doc["kind"] not in ("Kustomization", "Component"):
            assert doc["metadata"]["name"], path


def test_base_with_component_renders_a_runnable_sidecar(tmp_path: Path) -> None:
    docs = render_kustomization(K8S / "base")
    (deployment,) = by_kind(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    check_kvd_pod(deployment, configmaps, tmp_path)
    (service,) = by_kind(docs, "Service")
    check_service(service, deployment)
    secrets = {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    spec = deployment["spec"]["template"]["spec"]
    for volume in spec["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["secretName"] in secrets
        if "configMap" in volume:
            assert volume["configMap"]["name"] in configmaps
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_component_patch_targets_labelled_workloads_only() -> None:
    comp = load_docs(K8S / "components/kvd-sidecar/kustomization.yaml")[0]
    base = load_docs(K8S / "base/engine-deployment.yaml")[0]
    for patch in comp["patches"]:
        k, v = patch["target"]["labelSelector"].split("=")
        assert base["metadata"]["labels"][k] == v


def test_configmap_toml_loads_with_kvd_config(tmp_path: Path) -> None:
    from kvd.config import load

    (cm,) = load_docs(K8S / "components/kvd-sidecar/configmap.yaml")
    path = tmp_path / "kvd.toml"
    path.write_text(cm["data"]["kvd.toml"])
    cfg = load(path, env={})
    assert cfg.metrics_port == 7102 and cfg.drain_timeout_s == 30.0


def test_podmonitor_scrapes_a_named_port_of_the_pod() -> None:
    docs = render_kustomization(K8S / "base")
    (deployment,) = by_kind(docs, "Deployment")
    (monitor,) = load_docs(K8S / "monitoring/podmonitor.yaml")
    check_podmonitor(monitor, deployment)


def test_dashboard_configmap_and_raw_json() -> None:
    (cm,) = load_docs(K8S / "monitoring/grafana-dashboard.yaml")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    raw = (DEPLOY / "grafana/kvd-dashboard.json").read_text()
    assert cm["data"]["kvd-dashboard.json"] == raw
    check_dashboard(raw)


def test_strategic_merge_merges_lists_by_key() -> None:
    base = {"containers": [{"name": "engine", "image": "x", "env": [{"name": "A", "value": "1"}]}]}
    patch = {"containers": [{"name": "engine", "env": [{"name": "B", "value": "2"}]}]}
    merged = strategic_merge(base, patch)
    assert merged["containers"][0]["image"] == "x"
    assert [e["name"] for e in merged["containers"][0]["env"]] == ["A", "B"]
