"""The node-level shape: one kvd per node (DaemonSet) that engine pods reach through
host directories, from the Helm chart (mode: daemonset) and the kustomize component
(components/kvd-node), checked by the same assertions (kvd_pod_checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.kvd_pod_checks import (
    DEPLOY,
    check_kvd_pod,
    check_node_daemon,
    check_podmonitor,
    check_service,
    load_docs,
)
from support.render_manifests import K8S, by_kind, needs_renderer, render, render_kustomization

from kvd.config import load


def _configmaps(docs):
    return {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}


def _peer_service_selects_daemons_only(service, daemonset, engines):
    check_service(service, daemonset)
    selector = service["spec"]["selector"].items()
    for engine in engines:
        assert not selector <= engine["spec"]["template"]["metadata"]["labels"].items(), \
            "the peer Service must not select engine pods"


@needs_renderer
def test_helm_daemonset_mode_renders_a_node_daemon_and_its_engines(tmp_path: Path) -> None:
    docs = render({"mode": "daemonset", "podMonitor": {"enabled": True}})
    (daemonset,) = by_kind(docs, "DaemonSet")
    engines = by_kind(docs, "Deployment")
    assert len(engines) == 1
    cfg = check_node_daemon(daemonset, engines, _configmaps(docs), tmp_path)
    assert cfg.engine_address == "ipc:///run/kvd/engine.sock"
    assert cfg.pool_backing == "shm"
    (service,) = by_kind(docs, "Service")
    _peer_service_selects_daemons_only(service, daemonset, engines)
    (monitor,) = by_kind(docs, "PodMonitor")
    check_podmonitor(monitor, daemonset)
    assert not monitor["spec"]["selector"]["matchLabels"].items() <= \
        engines[0]["spec"]["template"]["metadata"]["labels"].items()
    # Deployment and DaemonSet selectors must not claim each other's pods.
    ds_sel = daemonset["spec"]["selector"]["matchLabels"].items()
    eng_sel = engines[0]["spec"]["selector"]["matchLabels"].items()
    assert not ds_sel <= engines[0]["spec"]["template"]["metadata"]["labels"].items()
    assert not eng_sel <= daemonset["spec"]["template"]["metadata"]["labels"].items()


@needs_renderer
def test_helm_daemonset_values_flow_into_paths_and_config(tmp_path: Path) -> None:
    docs = render({"mode": "daemonset",
                   "node": {"socketDir": "/var/run/kvd-sock/", "poolDir": "/mnt/huge/kvd"},
                   "kvd": {"config": {"pool_backing": "hugetlbfs", "shm_dir": "/ignored",
                                      "lease_s": 12.5}}})
    (daemonset,) = by_kind(docs, "DaemonSet")
    cfg = check_node_daemon(daemonset, by_kind(docs, "Deployment"), _configmaps(docs),
                            tmp_path)
    assert cfg.engine_address == "ipc:///var/run/kvd-sock/engine.sock"
    assert (cfg.pool_backing, cfg.lease_s) == ("hugetlbfs", 12.5)
    toml = _configmaps(docs)["demo-kvd-config"]["data"]["kvd.toml"]
    assert 'shm_dir = "/mnt/huge/kvd"' in toml and "/ignored" not in toml


@needs_renderer
@pytest.mark.parametrize(("values", "message"), [
    ({"mode": "node"}, "mode must be sidecar or daemonset"),
    ({"mode": "daemonset", "engine": {"securityContext": {"runAsUser": 1000}}},
     "must be node.uid"),
    ({"mode": "daemonset", "node": {"poolDir": "relative/pools"}}, "absolute"),
    ({"mode": "daemonset", "node": {"poolDir": "/run/kvd/"}}, "must differ"),
    ({"mode": "daemonset", "terminationGracePeriodSeconds": 30}, "drain_timeout_s"),
])
def test_helm_daemonset_refuses_values_that_cannot_run(values, message) -> None:
    with pytest.raises(Exception, match=message):
        render(values)


@needs_renderer
def test_helm_sidecar_mode_is_unchanged_by_default(tmp_path: Path) -> None:
    docs = render({})
    assert not by_kind(docs, "DaemonSet")
    (deployment,) = by_kind(docs, "Deployment")
    check_kvd_pod(deployment, _configmaps(docs), tmp_path)


def test_kustomize_node_example_renders_a_node_daemon(tmp_path: Path) -> None:
    docs = render_kustomization(K8S / "node")
    (daemonset,) = by_kind(docs, "DaemonSet")
    engines = by_kind(docs, "Deployment")
    cfg = check_node_daemon(daemonset, engines, _configmaps(docs), tmp_path)
    assert cfg.engine_address == "ipc:///run/kvd/engine.sock"
    (service,) = by_kind(docs, "Service")
    _peer_service_selects_daemons_only(service, daemonset, engines)
    secrets = {d["metadata"]["name"] for d in by_kind(docs, "Secret")}
    for workload in [daemonset, *engines]:
        for volume in workload["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets
    (monitor,) = load_docs(K8S / "monitoring/podmonitor-node.yaml")
    check_podmonitor(monitor, daemonset)


def test_kustomize_node_patch_targets_labelled_workloads_only() -> None:
    comp = load_docs(K8S / "components/kvd-node/kustomization.yaml")[0]
    engine = load_docs(K8S / "node/engine-deployment.yaml")[0]
    sidecar_engine = load_docs(K8S / "base/engine-deployment.yaml")[0]
    for patch in comp["patches"]:
        k, v = patch["target"]["labelSelector"].split("=")
        assert engine["metadata"]["labels"][k] == v
        assert sidecar_engine["metadata"]["labels"].get(k) != v  # the two shapes never mix


def test_helm_and_kustomize_node_configs_agree(tmp_path: Path) -> None:
    """The component's kvd.toml loads with kvd.config and matches the chart's defaults
    (same socket, pool directory and backing)."""
    (cm,) = load_docs(K8S / "components/kvd-node/configmap.yaml")
    text = cm["data"]["kvd.toml"]
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    cfg = load(path, env={"KVD_SHM_DIR": str(tmp_path)})
    values = yaml.safe_load((DEPLOY / "helm/kvd/values.yaml").read_text())
    assert cfg.engine_address == f"ipc://{values['node']['socketDir']}/engine.sock"
    assert f'shm_dir = "{values["node"]["poolDir"]}"' in text
    assert values["node"]["uid"] == values["kvd"]["securityContext"]["runAsUser"] \
        == values["engine"]["securityContext"]["runAsUser"]
    assert values["mode"] == "sidecar"
    assert values["node"]["hostIPC"] is False and values["node"]["hostPID"] is False
