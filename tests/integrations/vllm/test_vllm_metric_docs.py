"""docs/vllm.md's metric table (generated from the connector's source by scripts/gen_docs.py,
without vLLM) names exactly what the connector registers with vLLM's Prometheus."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from kvd.integrations.vllm.connector import KvdConnector  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]


def _gen_docs():  # noqa: ANN202 - a module loaded from a path
    spec = importlib.util.spec_from_file_location("gen_docs_vllm", ROOT / "scripts/gen_docs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_documented_names_are_the_registered_ones() -> None:
    registry = CollectorRegistry()

    def make(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(
            self, *a, registry=registry, **k)})

    class _Cfg:
        kv_transfer_config = None

    prom = KvdConnector.build_prom_metrics(
        _Cfg(), {Counter: make(Counter), Gauge: make(Gauge), Histogram: make(Histogram)},
        ["engine"], {0: ["0"]})
    prom.observe({"pulls_ok": 1, "durations_s": [0.01]}, 0)
    exported = {s.name for metric in registry.collect() for s in metric.samples
                if not s.name.endswith("_created")}
    documented = set()
    for name, _typ, _help in _gen_docs().vllm_connector_metrics():
        first, *rest = name.split(", ")
        documented.add(first)
        documented.update(first.rsplit("_", 1)[0] + suffix for suffix in rest)
    assert documented == exported
