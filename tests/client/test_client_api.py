"""The two clients offer the same API, and docs/engine-api.md names only what exists."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from kvd.client import AsyncKvdClient, KvdClient

DOC = (Path(__file__).resolve().parents[2] / "docs/engine-api.md").read_text()


def _public(cls: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, callable)
            if not name.startswith("_")}


def test_the_async_client_has_every_method_of_the_sync_one_with_the_same_parameters() -> None:
    sync, aio = _public(KvdClient), _public(AsyncKvdClient)
    assert set(sync) - set(aio) == set(), "AsyncKvdClient lacks methods of KvdClient"
    for name, sig in sync.items():
        assert list(sig.parameters) == list(aio[name].parameters), name
    assert set(aio) - set(sync) == {"aclose"}


def test_every_method_the_guide_names_exists_on_both_clients() -> None:
    table = DOC.split("| method |", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`(?:await )?(\w+)\(", table))
    assert named, "the method table is gone"
    for name in named - {"aclose"}:
        assert hasattr(KvdClient, name) and hasattr(AsyncKvdClient, name), name
    assert "aclose" in named and hasattr(AsyncKvdClient, "aclose")
