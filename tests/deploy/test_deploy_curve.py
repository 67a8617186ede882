"""CURVE in the deploy manifests: Helm (curve.enabled) and the kvd-curve kustomize
component give kvd its keypair and allowlist from Secrets, and kvd's own start-up
checks accept the result (tests/support/kvd_pod_checks.check_curve)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.kvd_pod_checks import check_curve, check_kvd_pod, load_docs
from support.render_manifests import K8S, by_kind, needs_renderer, render, render_kustomization

CURVE_VALUES = {"curve": {"enabled": True, "keypairSecret": "kvd-prefill-keypair",
                          "allowlistSecret": "kvd-fleet-allowlist"}}


@needs_renderer
def test_helm_curve_render_runs_kvd_with_keys_from_secrets(tmp_path: Path) -> None:
    docs = render(CURVE_VALUES)
    (deployment,) = by_kind(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    check_kvd_pod(deployment, configmaps, tmp_path)
    check_curve(deployment, configmaps, tmp_path,
                {"kvd-prefill-keypair", "kvd-fleet-allowlist"})
    # The chart creates no Secret for keys (they are made offline with `kvd keys`).
    assert all("key_secret" not in str(s.get("data", {})) for s in by_kind(docs, "Secret"))


@needs_renderer
def test_helm_curve_off_by_default_and_refused_without_secrets(tmp_path: Path) -> None:
    (deployment,) = by_kind(render({}), "Deployment")
    kvd = deployment["spec"]["template"]["spec"]["initContainers"][0]
    assert not [e for e in kvd["env"] if e["name"].startswith("KVD_CURVE")]
    with pytest.raises(Exception, match="curve.keypairSecret"):
        render({"curve": {"enabled": True}})


def test_kustomize_curve_component_on_the_base(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(K8S / "base")],
        "components": [str(K8S / "components/kvd-curve")],
        "secretGenerator": [
            {"name": "kvd-curve-keypair", "literals": ["kvd.key_secret=x"]},
            {"name": "kvd-curve-allowlist", "literals": ["decode.key=y"]}],
    }))
    docs = render_kustomization(overlay)
    (deployment,) = by_kind(docs, "Deployment")
    configmaps = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    check_kvd_pod(deployment, configmaps, tmp_path)
    check_curve(deployment, configmaps, tmp_path,
                {d["metadata"]["name"] for d in by_kind(docs, "Secret")})


def test_kustomize_curve_component_targets_the_sidecar_patch() -> None:
    comp = load_docs(K8S / "components/kvd-curve/kustomization.yaml")[0]
    side = load_docs(K8S / "components/kvd-sidecar/kustomization.yaml")[0]
    assert [p["target"] for p in comp["patches"]] == [p["target"] for p in side["patches"]]
