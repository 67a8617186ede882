"""Rendering the repository's manifests for the deploy tests: the Helm chart (through
helm-python-sdk or a helm binary) and the kustomize overlays (a small renderer of the
kustomize features deploy/k8s uses), and picking documents by kind."""

from __future__ import annotations

import copy
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.kvd_pod_checks import DEPLOY, Doc, load_docs, load_docs_text

CHART = DEPLOY / "helm/kvd"

try:
    import helm_python
except ImportError:  # pragma: no cover - depends on the environment
    helm_python = None

HELM_BIN = shutil.which("helm")
NO_RENDERER = "no Helm renderer: install helm-python-sdk (pip) or put a helm binary on PATH"


def render(values: dict[str, Any]) -> list[Doc]:
    if helm_python is not None:
        with helm_python.Chart.load(str(CHART)) as chart:
            out = chart.render(values, name="demo", namespace="serving")
        text = "\n---\n".join(v for k, v in sorted(out.items()) if k.endswith(".yaml"))
    elif HELM_BIN:
        args = [HELM_BIN, "template", "demo", str(CHART), "--namespace", "serving"]
        with tempfile.TemporaryDirectory() as tmp:
            values_file = Path(tmp) / "values.yaml"
            values_file.write_text(yaml.safe_dump(values))
            args += ["-f", str(values_file)]
            proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise RuntimeError(proc.stderr)
        text = proc.stdout
    else:  # pragma: no cover
        pytest.skip(NO_RENDERER)
    return load_docs_text(text)


needs_renderer = pytest.mark.skipif(helm_python is None and not HELM_BIN, reason=NO_RENDERER)


def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


K8S = DEPLOY / "k8s"
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}
SUPPORTED = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "patches",
    "secretGenerator",
    "labels",
    "images",
}


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        out = [copy.deepcopy(item) for item in base]
        index = {item[mk]: i for i, item in enumerate(out)}
        for item in patch:
            if item[mk] in index:
                out[index[item[mk]]] = strategic_merge(out[index[item[mk]]], item, None)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _matches(doc: Doc, target: Doc) -> bool:
    if doc["kind"] != target["kind"]:
        return False
    selector = target.get("labelSelector")
    if selector:
        k, v = selector.split("=", 1)
        return doc["metadata"].get("labels", {}).get(k) == v
    return doc["metadata"]["name"] == target.get("name")


def render_kustomization(directory: Path) -> list[Doc]:
    kust = load_docs(directory / "kustomization.yaml")[0]
    unknown = set(kust) - SUPPORTED
    assert not unknown, f"{directory}: test renderer does not support {unknown}"
    docs: list[Doc] = []
    for rel in kust.get("resources", []):
        path = directory / rel
        docs += render_kustomization(path) if path.is_dir() else load_docs(path)
    for gen in kust.get("secretGenerator", []):
        data = dict(item.split("=", 1) for item in gen.get("literals", []))
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": gen["name"]},
                "stringData": data,
            }
        )
    for rel in kust.get("components", []):
        component = directory / rel
        comp = load_docs(component / "kustomization.yaml")[0]
        assert comp["kind"] == "Component"
        assert set(comp) <= SUPPORTED
        for res in comp.get("resources", []):
            docs += load_docs(component / res)
        docs = _apply_patches(docs, comp.get("patches", []), component)
    docs = _apply_patches(docs, kust.get("patches", []), directory)
    for group in kust.get("labels", []):
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(group["pairs"])
    for image in kust.get("images", []):
        for doc in docs:
            if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
                spec = doc["spec"]["template"]["spec"]
                for c in spec.get("containers", []) + spec.get("initContainers", []):
                    if c.get("image", "").split(":")[0] == image["name"]:
                        c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


def _apply_patches(docs: list[Doc], patches: list[Doc], directory: Path) -> list[Doc]:
    for patch in patches:
        (body,) = load_docs(directory / patch["path"])
        hit = False
        for i, doc in enumerate(docs):
            if _matches(doc, patch["target"]):
                merged = strategic_merge(doc, {k: v for k, v in body.items() if k != "metadata"})
                merged["metadata"] = doc["metadata"]
                docs[i] = merged
                hit = True
        # the example base is a Deployment: its patch must apply (StatefulSet may not)
        assert hit or patch["target"]["kind"] != "Deployment", f"patch matched nothing: {patch}"
    return docs
