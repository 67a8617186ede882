"""Root conftest: the one daemon pair, and the multinode marker's skip.

pytest imports this file with ``tests/`` first on sys.path (its default "prepend" import
mode, ``tests/`` having no ``__init__.py``), so ``support`` (tests/support) is importable
from every test. Nothing else under tests/ may be named like a package a test imports:
``tests/integrations/__init__.py`` keeps ``tests/integrations`` off sys.path, so the
vLLM tests' folder ``tests/integrations/vllm`` is never the top-level ``vllm``.

``pair`` is one prefill and one decode ``kvd serve`` process (real NIXL) shared by a
whole module (starting one costs ~1 s); a module may set ``DAEMON_ARGS`` (extra
``kvd serve`` arguments for both). In-process daemons on the fake clock:
``support.inprocess.daemon_pair``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Two daemons of this one host stand for two nodes in the suites: their pulls go over
# NIXL, as between nodes. The host path (pool files mapped between daemons of one host)
# has its own tests, which turn it on with --set host_pulls=true (a flag beats this).
os.environ.setdefault("KVD_HOST_PULLS", "false")

from support.cluster import Pair, running_pair  # noqa: E402


@functools.cache
def _multinode_unavailable_reason() -> str | None:
    from support.multinode.harness import cannot_run

    return cannot_run()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``multinode`` (they build network namespaces) skip, naming why, where
    namespaces cannot be made (no root, no ``ip``/``unshare``)."""
    multinode = [item for item in items if item.get_closest_marker("multinode")]
    if not multinode or (why := _multinode_unavailable_reason()) is None:
        return
    for item in multinode:
        item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every temporary directory the code under test makes (``tempfile.mkdtemp``: the
    log directories of `kvd bench`, the router's, subprocesses' too) lands under
    pytest's own base directory, which pytest prunes (it keeps the newest three runs),
    instead of loose in /tmp."""
    import os
    import tempfile

    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # read TMPDIR again
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved
        tempfile.tempdir = None


@pytest.fixture(scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("kvd-logs")
    with running_pair(logs, list(getattr(request.module, "DAEMON_ARGS", []))) as p:
        yield p


def _reap_test_leftovers(shm_dir: Path = Path("/dev/shm")) -> list[str]:
    """Pools and locks of daemons the tests killed -9 under their own prefixes.

    No later daemon shares a killed test daemon's prefix, so nothing else would reap
    them; the suite does, once, at its end. Only dead owners' files go (the production
    reaper's rule: their lock can be taken), so a live daemon is never touched."""
    from kvd.pool.owner import reap_dead_pools

    prefixes = {lock.name[: -len(".lock")].rsplit("-", 2)[0]
                for lock in shm_dir.glob("kvd-*.lock")}
    removed: list[str] = []
    for prefix in sorted(p for p in prefixes if p.startswith("kvd-")):
        removed += reap_dead_pools(shm_dir, prefix)
    return removed


@pytest.fixture(scope="session", autouse=True)
def _no_shm_leftovers_after_the_suite() -> Iterator[None]:
    yield
    if Path("/dev/shm").is_dir():
        _reap_test_leftovers()
