"""What the whole-engine P->D modules share: a daemon pair per module, the connector's
kv_transfer_config, prefill/decode engines started and closed together, prompts.

vLLM-free on purpose (unlike pd_support, which the scheduler-level cases import and
which imports vLLM): whole engines run in child processes (engine_proc) and the test
process never imports vLLM (conftest).
"""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_proc import EngineProc

from kvd.tools.localcluster import DaemonProcess

BLOCK = 32  # CPU attention takes block sizes that are multiples of 32

StartEngine = Callable[..., EngineProc]  # the conftest's start_engine fixture


def kv_config(engine_id: str, daemon: DaemonProcess, **extra: Any) -> dict:
    """The kv_transfer_config ``vllm serve`` would get for a kvd-backed engine;
    ``extra``: more top-level fields (e.g. kv_load_failure_policy)."""
    return {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm",
            "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {"kvd_address": daemon.engine_address}, **extra}


def daemon_pair(tmp_path_factory: pytest.TempPathFactory, names: tuple[str, str],
                args: list[str] | None = None, crash_ok: bool = False
                ) -> Iterator[list[DaemonProcess]]:
    """The body of a module's ``daemons`` fixture: a prefill and a decode daemon named
    ``<names[i]><tag>``, yielded as a list (a test that restarts one puts the new one
    in its place). At the end each must exit 0 after SIGTERM; with ``crash_ok``
    (tests that freeze or kill them) each is thawed and killed instead."""
    logs = tmp_path_factory.mktemp(f"{names[0]}{names[1]}-daemons")
    tag = uuid.uuid4().hex[:6]
    pd = DaemonProcess.start(f"{names[0]}{tag}", logs, args)
    try:
        dd = DaemonProcess.start(f"{names[1]}{tag}", logs, args)
    except BaseException:
        pd.kill()
        raise
    running = [pd, dd]
    try:
        yield running
    finally:
        for d in [pd, dd, *(r for r in running if r is not pd and r is not dd)]:
            if crash_ok:
                if d.proc.poll() is None:
                    os.kill(d.proc.pid, signal.SIGCONT)
                d.kill()
                continue
            rc = d.stop()
            assert rc == 0, d.log_path.read_text()[-3000:]


def one_daemon(tmp_path_factory: pytest.TempPathFactory, name: str
               ) -> Iterator[list[DaemonProcess]]:
    """The body of a ``daemons`` fixture for one ``kvd serve`` serving both engines (the
    node-level shape): yielded as [daemon, daemon] so that start_pd puts the prefill and
    the decode engine on it, and their pulls are local copies. It must exit 0 at the end."""
    logs = tmp_path_factory.mktemp(f"{name}-daemon")
    d = DaemonProcess.start(f"{name}{uuid.uuid4().hex[:6]}", logs)
    try:
        yield [d, d]
    finally:
        rc = d.stop()
        assert rc == 0, d.log_path.read_text()[-3000:]


def start_pd(start_engine: StartEngine, daemons: list[DaemonProcess], names: tuple[str, str],
             **kwargs: Any) -> Iterator[tuple[EngineProc, EngineProc]]:
    """The body of an ``engines`` fixture: a prefill and a decode engine (engine ids
    ``<name>-<tag>``), each on its daemon of ``daemons``; both closed at the end, the
    first even when the second fails to start. ``kwargs``: kv_config extras."""
    pd, dd = daemons
    tag = uuid.uuid4().hex[:6]
    prefill = start_engine(names[0], kv_transfer_config=kv_config(f"{names[0]}-{tag}", pd,
                                                                  **kwargs),
                           block_size=BLOCK)
    try:
        decode = start_engine(names[1], kv_transfer_config=kv_config(f"{names[1]}-{tag}", dd,
                                                                     **kwargs),
                              block_size=BLOCK)
    except BaseException:
        prefill.close()
        raise
    try:
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


def start_plain_pd(start_engine: StartEngine, daemons: list[DaemonProcess], prefix: str,
                   model_dir: Path) -> Iterator[tuple[EngineProc, EngineProc, EngineProc]]:
    """The body of an ``engines`` fixture for a model of its own (hybrid families): a
    plain engine, a prefill and a decode engine, prefix caching off; yields (prefill,
    decode, plain), every one closed at the end."""
    pd, dd = daemons
    tag = uuid.uuid4().hex[:6]
    started: list[EngineProc] = []
    try:
        for role, cfg in (("plain", None), ("prefill", kv_config(f"{prefix}-p-{tag}", pd)),
                          ("decode", kv_config(f"{prefix}-d-{tag}", dd))):
            started.append(start_engine(f"{prefix}-{role}", model_dir=model_dir,
                                        kv_transfer_config=cfg, block_size=BLOCK,
                                        enable_prefix_caching=False))
        plain, prefill, decode = started
        yield prefill, decode, plain
    finally:
        for e in reversed(started):
            e.close()


def random_prompts(n: int, length: int, seed: int, step: int = 7) -> list[list[int]]:
    """``n`` random prompts of ``length``, ``length + step``, ... tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length + i * step)] for i in range(n)]


def prefill_outputs(prefill: EngineProc, prompts: list[list[int]]
                    ) -> tuple[list[dict], list[dict]]:
    """The router's first half, as vLLM's toy proxy does it: prefill each prompt with
    max_tokens=1 and do_remote_decode; the outputs and their kv_transfer_params."""
    first = prefill.generate(prompts, max_tokens=1,
                             kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))
    params = [r["kv_transfer_params"] for r in first]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return first, params


def prefill_params(prefill: EngineProc, prompts: list[list[int]]) -> list[dict]:
    """Prefill each prompt (one token) for a remote decode; its kv_transfer_params."""
    return prefill_outputs(prefill, prompts)[1]


def wait_nothing_held(prefill_daemon: DaemonProcess, decode_daemon: DaemonProcess,
                      timeout_s: float = 15.0) -> None:
    """Until the prefill daemon holds nothing and the decode daemon has no pull left:
    every published prefill was read and released."""
    deadline = time.monotonic() + timeout_s
    while True:
        with prefill_daemon.client(ping_interval_s=0) as pc, \
                decode_daemon.client(ping_interval_s=0) as dc:
            held, pulls = len(pc.status().held), len(dc.status().pulls)
        if held == 0 and pulls == 0:
            return
        assert time.monotonic() < deadline, f"prefill still holds {held}, decode pulls {pulls}"
        time.sleep(0.2)
