"""Progressive P/D through whole vLLM engines: the request goes to the prefill and the
decode engine at once (as ``kvd router --progressive`` sends it); the prefill engine
(chunked prefill, small ``max_num_batched_tokens``) seals each chunk, the decode's daemon
reads it while the prefill computes the next, and the decode's tokens equal a plain
engine's. Aborting the decode mid-prompt ends the pull and lets the prefill's blocks go;
a prefill engine killed mid-prompt, or one that never comes, fails the pull and the
decode recomputes the prompt (``kv_load_failure_policy="recompute"``): the same tokens.

The engines step only inside ``poll`` (engine_proc), so each is polled from its own
thread, as two servers would run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_proc import DEFAULT_KV_CACHE_BYTES, EngineProc, EngineProcError
from engine_support import BLOCK, StartEngine, daemon_pair, kv_config, random_prompts
from proc_probe import descendants

from kvd.integrations.connector_core.params import ProgressivePrefill
from kvd.tools.localcluster import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 8
CHUNK = 64  # the prefill's max_num_batched_tokens: a 600-token prompt takes 10 steps
HOLD_S = 15  # the decode daemon's progressive_hold_s
LONG = 2048  # tokens: 32 prefill steps, time to act between the first range and the last


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProcess]]:
    yield from daemon_pair(tmp_path_factory, ("gp", "gd"), args=["--set", "host_pulls=false",
                                                        "--set", f"progressive_hold_s={HOLD_S}"])


@pytest.fixture(scope="module")
def engines(daemons: list[DaemonProcess], start_engine: StartEngine,
            reference_engine: EngineProc) -> Iterator[dict[str, Any]]:
    pd, dd = daemons
    tag = uuid.uuid4().hex[:6]
    pid, did = f"gprefill-{tag}", f"gdecode-{tag}"
    prefill = start_engine("gprefill", kv_transfer_config=kv_config(pid, pd),
                           block_size=BLOCK, llm_kwargs={"enable_chunked_prefill": True,
                                                         "max_num_batched_tokens": CHUNK})
    try:
        decode = start_engine("gdecode", kv_transfer_config=kv_config(
            did, dd, kv_load_failure_policy="recompute"), block_size=BLOCK)
    except BaseException:
        prefill.close()
        raise
    try:
        yield {"prefill": prefill, "decode": decode, "plain": reference_engine,
               "prefill_id": pid, "prefill_address": pd.peer_address}
    finally:
        decode.close()
        prefill.close()


def _run(engine: EngineProc, requests: list[dict[str, Any]], out: dict[str, Any],
         timeout_s: float = 120.0, dead_ok: bool = False,
         during: Callable[[EngineProc], int] | None = None) -> None:
    """Submit ``requests`` and poll ``engine`` until each returned; ``during(engine)``,
    after each poll (in this thread, which alone talks to ``engine``): how many of them
    it has aborted (they return no result)."""
    try:
        engine.submit(requests)
        deadline = time.monotonic() + timeout_s
        aborted = 0
        step_s = 0.2 if during is None else 0.05
        while len(out) + aborted < len(requests) and time.monotonic() < deadline:
            for r in engine.poll(step_s=step_s):
                out[r["request_id"]] = r
            if during is not None:
                aborted = during(engine)
    except EngineProcError:
        if not dead_ok:
            raise


def _at_once(e: dict[str, Any], prompts: list[list[int]],
             prefill_params: list[dict[str, Any] | None] | None = None,
             decode_only: bool = False, prefill: EngineProc | None = None,
             during: Callable[[EngineProc], int] | None = None,
             prefill_during: Callable[[EngineProc], int] | None = None,
             prefill_first: list[dict[str, Any]] | None = None,
             timeout_s: float = 120.0) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Each prompt to both engines at once; (prefill results, decode results, ids).
    ``prefill``: another prefill engine on the same daemon (one the test kills or
    preempts). ``during(decode)``, after each poll of the decode: how many decode
    requests it has aborted (they return no result); ``prefill_during(prefill)`` the
    same on the prefill's thread. ``prefill_first``: requests the prefill engine gets
    ahead of the prompts, in the same submit (vLLM schedules them first)."""
    tids = [f"t-{uuid.uuid4().hex[:10]}" for _ in prompts]
    pre = [{"request_id": f"p{i}", "prompt": p, "max_tokens": 1,
            "kv_transfer_params": (prefill_params[i] if prefill_params else
                                   {"do_remote_decode": True, "kvd_progressive": True,
                                    "kvd_transfer_id": t})}
           for i, (p, t) in enumerate(zip(prompts, tids, strict=True))]
    dec = [{"request_id": f"d{i}", "prompt": p, "max_tokens": MAX_TOKENS,
            "kv_transfer_params": ProgressivePrefill(e["prefill_id"], t,
                                                     e["prefill_address"]).to_params()}
           for i, (p, t) in enumerate(zip(prompts, tids, strict=True))]
    got_p: dict[str, Any] = {}
    got_d: dict[str, Any] = {}
    decode = e["decode"]
    # The decode admits its requests first (their pulls wait at the prefill's daemon), so
    # that how many ranges are read does not depend on which engine this host ran first.
    t0 = time.monotonic()
    decode.submit(dec)
    for _ in range(3):
        for r in decode.poll(step_s=0.2):
            got_d[r["request_id"]] = r
    held_s = time.monotonic() - t0
    assert held_s < HOLD_S / 3, (
        f"the decode's polls took {held_s:.1f} s: the prefill would start after its pulls "
        "gave up (EngineProc.poll must return while the decode waits for remote KV)")
    worker = None
    if not decode_only:
        worker = threading.Thread(target=_run, args=(prefill or e["prefill"],
                                                     [*(prefill_first or []), *pre], got_p),
                                  kwargs={"dead_ok": prefill is not None,
                                          "during": prefill_during, "timeout_s": timeout_s})
        worker.start()
    aborted = 0
    deadline = time.monotonic() + timeout_s
    step_s = 0.2 if during is None else 0.05  # ``during`` acts mid-prompt: look often
    while len(got_d) + aborted < len(dec) and time.monotonic() < deadline:
        for r in decode.poll(step_s=step_s):
            got_d[r["request_id"]] = r
        if during is not None:
            aborted = during(decode)
    if worker is not None:
        worker.join()
    return got_p, got_d, tids


def _ranges_read(dd: DaemonProcess) -> float:
    return dd.metric("kvd_transfers_total", role="consumer", outcome="ok")


def _cpu_s(engine: EngineProc) -> float:
    """CPU seconds (user + system) the engine's processes have used so far."""
    ticks = 0
    for pid in descendants(engine.proc.pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _held(d: DaemonProcess, engine_id: str) -> list[Any]:
    with d.client(ping_interval_s=0) as c:
        return [h for h in c.status().held if h.engine_id == engine_id]


def test_progressive_decode_equals_a_plain_engine(engines: dict[str, Any],
                                                  daemons: list[DaemonProcess]) -> None:
    _, dd = daemons
    prompts = random_prompts(2, 600, seed=51)
    want = engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
    reads0 = dd.metric("kvd_transfers_total", role="consumer", outcome="ok")
    got_p, got_d, _ = _at_once(engines, prompts)
    assert len(got_p) == 2 and len(got_d) == 2
    for i, w in enumerate(want):
        g = got_d[f"d{i}"]
        assert g["token_ids"] == w["token_ids"], (
            f"progressive decode diverged from plain; decode daemon's log:\n"
            f"{dd.log_path.read_text(errors='replace')[-3000:]}")
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        assert g["prompt_tokens_computed"] <= 1, g  # the prompt came from kvd
    reads = dd.metric("kvd_transfers_total", role="consumer", outcome="ok") - reads0
    assert reads > 2 * 2, f"{reads} range pulls: the chunks were not read as they came"


def test_a_prefill_that_never_comes_fails_the_pull_after_the_hold_timeout(
        engines: dict[str, Any]) -> None:
    """The prefill request never comes (the router's prefill call failed): the decode's
    pull fails after progressive_hold_s (15 s here), never ok with wrong bytes; under
    vLLM's failure policy the decode request then fails (or recomputes: the same
    tokens), and the engines keep serving."""
    prompts = random_prompts(1, 300, seed=61)
    want = engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
    decode = engines["decode"]
    cpu0, t0 = _cpu_s(decode), time.monotonic()
    _, got_d, _ = _at_once(engines, prompts, decode_only=True)
    wall_s = time.monotonic() - t0
    assert wall_s < 90
    # What a decode engine costs while its only request waits for a progressive pull
    # (vLLM's engine core steps on while it has requests; the connector parks each idle
    # step kvd_idle_wait_s): CPU the prefill engine, on a CPU host, does not get.
    cpu_s, (steps, _) = _cpu_s(decode) - cpu0, decode.steps_in([(t0, t0 + wall_s)])
    print(f"\ndecode waiting {wall_s:.1f} s for a pull that fails: {steps} steps "
          f"({steps / wall_s:.0f}/s), {cpu_s:.1f} CPU s ({cpu_s / wall_s:.2f} cores)")
    assert got_d["d0"]["token_ids"] in (want[0]["token_ids"], []) or \
        got_d["d0"]["finish_reason"] not in ("length", "stop")
    # afterwards a progressive request still goes through
    _, got_d, _ = _at_once(engines, prompts)
    assert got_d["d0"]["token_ids"] == want[0]["token_ids"]


def test_a_decode_aborted_mid_prompt_cancels_its_pull_and_the_prefill_lets_go(
        engines: dict[str, Any], daemons: list[DaemonProcess]) -> None:
    """The decode's client goes away after the first range was read: its connector
    cancels the pull, the decode daemon abandons the producer's hold, and the prefill's
    complete seal is answered at once (its blocks freed, nothing held)."""
    pd, dd = daemons
    prompts = random_prompts(1, LONG, seed=71)
    reads0 = _ranges_read(dd)
    aborted: list[str] = []

    def abort_after_the_first_range(decode: EngineProc) -> int:
        if not aborted and _ranges_read(dd) > reads0:
            aborted.extend(decode.abort(["d0"]))
        return len(aborted)

    got_p, got_d, _ = _at_once(engines, prompts, during=abort_after_the_first_range)
    assert aborted == ["d0"] and got_d == {}, "the decode finished before its abort"
    assert set(got_p) == {"p0"}, "the prefill did not finish"
    deadline = time.monotonic() + 15
    while _held(pd, engines["prefill_id"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _held(pd, engines["prefill_id"]), "the prefill daemon still holds the request"
    print(f"\ndecode aborted after {_ranges_read(dd) - reads0:.0f} range(s) read "
          f"(of up to {LONG // CHUNK})")
    # the engines go on serving progressive requests
    short = random_prompts(1, 300, seed=72)
    want = engines["plain"].generate(short, max_tokens=MAX_TOKENS)
    _, got_d, _ = _at_once(engines, short)
    assert got_d["d0"]["token_ids"] == want[0]["token_ids"]
    assert got_d["d0"]["prompt_tokens_computed"] <= 1


def test_a_prefill_engine_killed_mid_prompt_the_decode_recomputes(
        engines: dict[str, Any], daemons: list[DaemonProcess],
        start_engine: StartEngine) -> None:
    """The prefill engine (its three processes) is SIGKILLed after the decode's daemon
    read its first range: the prefill daemon sees its engine leave, the pull fails, and
    the decode computes the prompt itself: the plain engine's tokens, within the hold
    timeout of the kill."""
    pd, dd = daemons
    pid = f"gkill-{uuid.uuid4().hex[:6]}"
    # One block a step over a longer prompt (96 steps): the kill must come before its end.
    victim = start_engine("gkill", kv_transfer_config=kv_config(pid, pd), block_size=BLOCK,
                          llm_kwargs={"enable_chunked_prefill": True,
                                      "max_num_batched_tokens": BLOCK})
    try:
        prompts = random_prompts(1, 3 * 1024, seed=81)
        want = engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
        reads0 = _ranges_read(dd)
        killed: list[float] = []

        def kill_after_the_first_range(decode: EngineProc) -> int:
            if not killed and _ranges_read(dd) > reads0:
                os.killpg(victim.proc.pid, signal.SIGKILL)  # its own session (EngineProc)
                killed.append(time.monotonic())
            return 0

        got_p, got_d, _ = _at_once(dict(engines, prefill_id=pid), prompts, prefill=victim,
                                   during=kill_after_the_first_range)
        assert killed and got_p == {}, "the prefill finished before it was killed"
        g = got_d["d0"]
        assert g["token_ids"] == want[0]["token_ids"]
        assert g["prompt_tokens_computed"] > 1, g  # the decode computed the prompt itself
        answered_s = max(g["token_times"]) - killed[0]
        assert answered_s < HOLD_S + 10, f"the decode answered {answered_s:.1f} s after the kill"
        print(f"\nprefill engine killed mid-prompt: the decode answered {answered_s:.2f} s "
              f"after the kill, {_ranges_read(dd) - reads0:.0f} ranges read before")
    finally:
        victim.close()


def _settled(pd: DaemonProcess, dd: DaemonProcess, engine_id: str,
             timeout_s: float = HOLD_S + 15) -> None:
    """Until the prefill daemon holds nothing of ``engine_id`` and the decode daemon has no
    pull left."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = _held(pd, engine_id)
        with dd.client(ping_interval_s=0) as c:
            pulls = c.status().pulls
        if not held and not pulls:
            return
        assert time.monotonic() < deadline, (
            f"after {timeout_s:.0f} s the prefill daemon holds {held}, the decode daemon "
            f"pulls {pulls}")
        time.sleep(0.2)


def test_a_prefill_aborted_mid_prompt_fails_the_pull_and_the_decode_recomputes(
        engines: dict[str, Any], daemons: list[DaemonProcess]) -> None:
    """The prefill's client goes away after the decode's daemon read the first range: the
    prefill's connector aborts its seals, the decode's pull fails, and the decode
    (``kv_load_failure_policy="recompute"``) computes the prompt: the plain engine's
    tokens, never a mix of the ranges read and garbage; the prefill daemon lets go."""
    pd, dd = daemons
    prompts = random_prompts(1, LONG, seed=91)
    want = engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
    reads0 = _ranges_read(dd)
    aborted: list[str] = []

    def abort_after_the_first_range(prefill: EngineProc) -> int:
        if not aborted and _ranges_read(dd) > reads0:
            aborted.extend(prefill.abort(["p0"]))
        return len(aborted)

    got_p, got_d, _ = _at_once(engines, prompts, prefill_during=abort_after_the_first_range)
    assert aborted == ["p0"] and got_p == {}, "the prefill finished before its abort"
    g = got_d["d0"]
    assert g["token_ids"] == want[0]["token_ids"]
    assert g["logprobs"] == pytest.approx(want[0]["logprobs"], abs=1e-4)
    assert g["prompt_tokens_computed"] > 1, g  # the decode computed the prompt itself
    _settled(pd, dd, engines["prefill_id"])
    print(f"\nprefill aborted after {_ranges_read(dd) - reads0:.0f} range(s) read; the "
          f"decode computed {g['prompt_tokens_computed']} prompt tokens")


def test_a_prefill_preempted_mid_prompt_is_read_again_never_mixed(
        engines: dict[str, Any], daemons: list[DaemonProcess],
        start_engine: StartEngine) -> None:
    """A prefill engine with room for 67 blocks gets a plain 1024-token request and then
    the progressive 2048-token one: once the plain one decodes, the progressive one runs
    out of blocks while its chunks are being read and vLLM preempts it (its blocks
    freed, its prompt computed again into others), more than once. Its connector
    unseals; the decode's daemon throws away the ranges it read and reads the new
    generation: the decode loads the prompt and its tokens are the plain engine's."""
    pd, dd = daemons
    pid = f"gpreempt-{uuid.uuid4().hex[:6]}"
    blocks = 68  # the plain request's 34 blocks + about 33 of the progressive one's 64
    block_bytes = DEFAULT_KV_CACHE_BYTES // engines["prefill"].info["num_gpu_blocks"]
    small = start_engine("gpreempt", kv_transfer_config=kv_config(pid, pd), block_size=BLOCK,
                         enable_prefix_caching=False, kv_cache_memory_bytes=blocks * block_bytes,
                         max_model_len=(blocks - 2) * BLOCK,  # vLLM gets 67 of them
                         llm_kwargs={"enable_chunked_prefill": True,
                                     "max_num_batched_tokens": CHUNK,
                                     # admit a prompt whose blocks are not all free (vLLM's
                                     # default waits until they are, and never preempts)
                                     "scheduler_reserve_full_isl": False})
    try:
        assert small.info["num_gpu_blocks"] <= blocks, small.info
        prompts = random_prompts(1, LONG, seed=95)
        first = [{"request_id": "q0", "prompt": random_prompts(1, 1024, seed=96)[0],
                  "max_tokens": 64, "kv_transfer_params": None}]
        want = engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
        reads0 = _ranges_read(dd)
        got_p, got_d, _ = _at_once(dict(engines, prefill_id=pid), prompts, prefill=small,
                                   prefill_first=first)
        assert set(got_p) == {"q0", "p0"}, got_p.keys()
        computed = got_p["p0"]["prompt_tokens_computed"]
        assert computed > LONG, f"the prefill was not preempted: it computed {computed} tokens"
        g = got_d["d0"]
        assert g["token_ids"] == want[0]["token_ids"]
        assert g["logprobs"] == pytest.approx(want[0]["logprobs"], abs=1e-4)
        assert g["prompt_tokens_computed"] <= 1, g  # the last generation came from kvd
        reads = _ranges_read(dd) - reads0
        _settled(pd, dd, pid)
        print(f"\nprefill preempted: it computed {computed} prompt tokens for {LONG}; the "
              f"decode's daemon read {reads:.0f} ranges")
    finally:
        small.close()


@pytest.mark.parametrize(("role", "freeze_s"), [("prefill", 4.0), ("prefill", HOLD_S + 5.0),
                                                ("decode", HOLD_S + 5.0)])
def test_a_daemon_frozen_mid_prompt_the_decode_loads_or_recomputes(
        engines: dict[str, Any], daemons: list[DaemonProcess], role: str,
        freeze_s: float) -> None:
    """The prefill's or the decode's daemon is frozen (SIGSTOP of its process group) after
    the first range was read, and thawed ``freeze_s`` later or once the decode answered:
    the decode's request ends with the plain engine's tokens (loaded, or recomputed when
    the pull failed), both daemons let go of it, and the next progressive request loads
    its prompt; the decode engine steps on during the freeze."""
    pd, dd = daemons
    victim = pd if role == "prefill" else dd
    # a prompt of its own: the prefill engine's prefix cache would hand it all at once
    prompts = random_prompts(1, LONG, seed=101 + int(freeze_s) + (role == "decode"))
    want = engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
    reads0 = _ranges_read(dd)
    frozen: list[float] = []  # when it was stopped, when thawed

    def freeze_after_the_first_range(decode: EngineProc) -> int:
        now = time.monotonic()
        if not frozen and _ranges_read(dd) > reads0:
            os.killpg(victim.proc.pid, signal.SIGSTOP)
            frozen.append(now)
        elif len(frozen) == 1 and now - frozen[0] >= freeze_s:
            os.killpg(victim.proc.pid, signal.SIGCONT)
            frozen.append(now)
        return 0

    try:
        got_p, got_d, _ = _at_once(engines, prompts, during=freeze_after_the_first_range,
                                   timeout_s=freeze_s + 120)
    finally:
        if len(frozen) == 1:
            os.killpg(victim.proc.pid, signal.SIGCONT)
            frozen.append(time.monotonic())
    assert frozen, "the decode finished before the first range was read"
    # the decode engine steps on while its request waits (nothing in a step waits on kvd)
    steps, slow = engines["decode"].steps_in([(frozen[0], frozen[1])])
    assert steps > 0, "the decode engine did not step while the daemon was frozen"
    g = got_d["d0"]
    assert g["token_ids"] == want[0]["token_ids"]
    assert g["logprobs"] == pytest.approx(want[0]["logprobs"], abs=1e-4)
    _settled(pd, dd, engines["prefill_id"])
    how = "loaded" if g["prompt_tokens_computed"] <= 1 else "recomputed"
    print(f"\n{role} daemon frozen {frozen[1] - frozen[0]:.1f} s after "
          f"{_ranges_read(dd) - reads0:.0f} range(s): the decode {how} the prompt, answered "
          f"{max(g['token_times']) - frozen[0]:.1f} s after the freeze; prefill "
          f"{'done' if got_p else 'not done'}; the decode engine stepped {steps} times in "
          f"the freeze, longest step {max(slow, default=0.0):.2f} s")
    short = random_prompts(1, 300, seed=102)
    want = engines["plain"].generate(short, max_tokens=MAX_TOKENS)
    _, got_d, _ = _at_once(engines, short)
    assert got_d["d0"]["token_ids"] == want[0]["token_ids"]
    assert got_d["d0"]["prompt_tokens_computed"] <= 1


@pytest.fixture(scope="module")
def hybrid_engines(daemons: list[DaemonProcess], start_engine: StartEngine,
                   tiny_hybrid_dir: Path) -> Iterator[dict[str, Any]]:
    """The tiny Nemotron-H (Mamba + attention): a chunked prefill, a decode and a plain
    engine (prefix caching off: vLLM's CPU Mamba2 needs it, test_engine_hybrid.py)."""
    pd, dd = daemons
    tag = uuid.uuid4().hex[:6]
    pid = f"hprefill-{tag}"
    started: list[EngineProc] = []
    try:
        for name, cfg, kw in (
                ("hplain", None, {}),
                ("hprefill", kv_config(pid, pd), {"enable_chunked_prefill": True,
                                                  "max_num_batched_tokens": CHUNK}),
                ("hdecode", kv_config(f"hdecode-{tag}", dd), {})):
            started.append(start_engine(name, model_dir=tiny_hybrid_dir, kv_transfer_config=cfg,
                                        block_size=BLOCK, enable_prefix_caching=False,
                                        llm_kwargs=kw))
        plain, prefill, decode = started
        yield {"prefill": prefill, "decode": decode, "plain": plain, "prefill_id": pid,
               "prefill_address": pd.peer_address}
    finally:
        for e in reversed(started):
            e.close()


def test_a_hybrid_model_progressively_equals_a_plain_engine(
        hybrid_engines: dict[str, Any], daemons: list[DaemonProcess]) -> None:
    """Mamba + attention: the prefill seals the attention blocks per chunk and every
    group (the Mamba state after N-1 tokens with them) once complete; the decode's
    daemon reads them in one pull, and the decode computes only the last prompt token."""
    pd, dd = daemons
    prompts = random_prompts(2, 600, seed=81)
    want = hybrid_engines["plain"].generate(prompts, max_tokens=MAX_TOKENS)
    reads0 = _ranges_read(dd)
    got_p, got_d, _ = _at_once(hybrid_engines, prompts)
    assert len(got_p) == 2 and len(got_d) == 2
    for i, (p, w) in enumerate(zip(prompts, want, strict=True)):
        g = got_d[f"d{i}"]
        assert g["token_ids"] == w["token_ids"], (
            f"hybrid progressive decode diverged from plain; decode daemon's log:\n"
            f"{dd.log_path.read_text(errors='replace')[-3000:]}")
        assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
        assert g["prompt_tokens_computed"] == 1, g  # N-1 tokens and the state from kvd
        assert g["first_start"] == len(p) - 1, g
    reads = _ranges_read(dd) - reads0
    print(f"hybrid progressive: {reads:g} pulls ok at the decode's daemon for 2 requests")
    assert reads >= 2
    _settled(pd, dd, hybrid_engines["prefill_id"])
