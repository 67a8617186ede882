"""Prefill -> decode through kvd, driven by vLLM's real scheduler against real daemons.

Each case runs vLLM's ``Scheduler`` (which builds the scheduler-side
``KvdConnector`` from the kv_transfer_config, exactly as ``vllm serve`` would)
and worker-side ``KvdConnector``s whose KV caches vLLM's ``allocate_kv_cache``
carved out of kvd's shm pools; two ``kvd serve`` processes on loopback move
the bytes. The fake forward pass writes a per-engine KV pattern, so the
decode side's blocks are checked byte for byte at the step kvd reports them
received. Every case ends with both schedulers idle and holding no block
(``scheduler_support.drain``): a leak in the connector's hand-off shows up as a
request or a block left behind.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from pd_support import (  # noqa: E402
    BLOCK,
    DAEMON_ARGS,
    PROMPT,
    PROMPT_TOKENS,
    Daemons,
    MakeEngine,
    block_nbytes,
    check_pulled,
    generated,
    held,
    n_blocks,
    pull_to_decode,
)
from scheduler_support import (  # noqa: E402
    SAMPLED_TOKEN,
    drain,
    kill_daemon,
    prefill,
    prompt_tokens,
    run_until,
    start_daemon,
)

import kvd.integrations.connector_core.scheduler as kvd_vllm_scheduler  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

# The shared fixtures (module-scoped daemons: each module gets its own pair).


# ------------------------------------------------------------------ the basic hand-off


@pytest.mark.parametrize("length", [PROMPT, 3 * BLOCK, 20])
def test_basic_prefill_to_decode(length: int, daemons: Daemons, engines: MakeEngine) -> None:
    """P publishes on request_finished and holds its blocks; D pulls all of them, decodes
    after computing only the last prompt token; P's blocks come back once D read them.
    Prompts end inside a block, on a block boundary, and inside the first block."""
    p = engines("prefill", daemons.prefill)
    d = engines("decode", daemons.decode)
    prompt = prompt_tokens(length, length)
    params = prefill(p, "req-0", prompt)

    p_blocks = p.block_ids("req-0")
    n = n_blocks(length, BLOCK)
    assert params["remote_engine_id"] == p.engine_id
    assert params["remote_request_id"] == "req-0"
    assert params["remote_block_ids"] == p_blocks[:n]
    assert params["remote_num_tokens"] == length
    assert params["kvd_address"] == daemons.prefill.peer_address
    assert p.num_free_blocks() == p.initial_free - len(p_blocks), "P must hold the blocks"
    [h] = run_until([], lambda: held(daemons.prefill, p), timeout_s=5,
                    what="the publish held")  # it leaves without a wait
    assert (h.request_id, h.blocks) == ("req-0", n)

    d.add("dec-0", prompt, max_tokens=3, kv_transfer_params=params)
    run_until([p, d], lambda: "dec-0" in d.received, what="dec-0 received")
    check_pulled(d, "dec-0", p, 0, length)
    got = d.received["dec-0"]
    assert d.nonzero_outside(got.block_ids[:n], got.caches) == 0, "kvd wrote other blocks"

    run_until([p, d], lambda: d.finished("dec-0"), what="decode to finish")
    assert d.computed["dec-0"][0] == (length - 1, length), "D recomputed more than 1 token"
    assert generated(d, "dec-0") == [SAMPLED_TOKEN] * 3
    assert d.stat("pulls_ok") == 1 and d.stat("nbytes") == n * block_nbytes(d)
    drain([p, d])
    assert p.stat("sends_ok") == 1 and not held(daemons.prefill, p)


# ------------------------------------------------------------------ prefix cache


def test_partial_prefix_hit_pulls_only_the_tail(daemons: Daemons, engines: MakeEngine) -> None:
    """D already caches the first two blocks of the prompt: kvd reads only the other two,
    and D's cached prefix keeps D's own bytes."""
    p = engines("prefill", daemons.prefill)
    d = engines("decode", daemons.decode)
    d.add("warm", PROMPT_TOKENS[:70], max_tokens=1)  # caches tokens [0, 64): 2 full blocks
    run_until([d], lambda: d.finished("warm"), what="warm-up")
    drain([d])
    params = prefill(p, "req-1", PROMPT_TOKENS)

    pull_to_decode(p, d, params, "dec-1")
    got = d.received["dec-1"]
    assert not got.failed
    hit = 2 * BLOCK
    assert d.kv_mismatches(got.block_ids, 0, hit, d.tag, got.caches) == 0, \
        "the locally cached prefix was overwritten"
    check_pulled(d, "dec-1", p, hit, PROMPT)
    assert d.stat("nbytes") == (n_blocks(PROMPT, BLOCK) - 2) * block_nbytes(d)

    run_until([p, d], lambda: d.finished("dec-1"), what="decode to finish")
    assert d.computed["dec-1"][0] == (PROMPT - 1, PROMPT)
    drain([p, d])


def test_full_prefix_hit_sends_notify_only_pull(daemons: Daemons, engines: MakeEngine) -> None:
    """D's cache already covers every token P computed: nothing is read, D does not wait,
    and P's blocks are released at once (not at the end of its 30 s lease).

    With identical prompts this cannot happen in vLLM: a local hit stops one token short
    of the prompt, rounded down to a block, so the last block is always pulled. Here P's
    prompt is the first two blocks of D's (a follow-up turn whose prefix D cached).
    """
    p = engines("prefill", daemons.prefill, lease_s=30.0)
    d = engines("decode", daemons.decode)
    d.add("warm", PROMPT_TOKENS[:97], max_tokens=1)  # caches [0, 96): 3 full blocks
    run_until([d], lambda: d.finished("warm"), what="warm-up")
    drain([d])
    params = prefill(p, "req-2", PROMPT_TOKENS[:64])
    assert params["remote_num_tokens"] == 64

    start = time.monotonic()
    d.add("dec-2", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
    run_until([p, d], lambda: not p.has_work(), timeout_s=10, what="P to be released")
    assert time.monotonic() - start < 10
    assert not held(daemons.prefill, p)
    run_until([p, d], lambda: d.finished("dec-2"), what="decode to finish")
    assert "dec-2" not in d.received, "vLLM waited for a notify-only pull"
    assert d.computed["dec-2"][0] == (96, PROMPT), "D must compute what its cache lacks"
    assert d.stat("nbytes") == 0
    drain([p, d])
    assert p.stat("sends_ok") == 1


# ------------------------------------------------------------------ aborts and leases


def test_prefill_abort_publishes_nothing(daemons: Daemons, engines: MakeEngine) -> None:
    """A prefill aborted mid-prompt frees its blocks at once and is never published."""
    p = engines("prefill", daemons.prefill, max_batched_tokens=64)  # 2 steps per prompt
    p.add("req-3", PROMPT_TOKENS, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    p.step()
    assert p.status("req-3") == "RUNNING" and p.computed["req-3"] == [(0, 64)]
    assert p.num_free_blocks() < p.initial_free
    p.abort("req-3")
    assert p.num_free_blocks() == p.initial_free
    drain([p])
    assert not held(daemons.prefill, p)
    assert p.finished("req-3") is None  # an abort from outside produces no output


def test_decode_abort_before_scheduled_releases_prefill(daemons: Daemons,
                                                        engines: MakeEngine) -> None:
    """D aborts the request before scheduling it: a notify-only pull releases P at once."""
    p = engines("prefill", daemons.prefill, lease_s=30.0)
    d = engines("decode", daemons.decode)
    params = prefill(p, "req-4", PROMPT_TOKENS)
    d.add("dec-4", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
    d.abort("dec-4")
    start = time.monotonic()
    drain([p, d], timeout_s=10)
    assert time.monotonic() - start < 10, "P held its blocks until the lease"
    assert not held(daemons.prefill, p)
    assert d.stat("nbytes") == 0 and "dec-4" not in d.computed
    assert p.stat("sends_ok") == 1


def test_decode_abort_while_waiting_for_kv(daemons: Daemons, engines: MakeEngine) -> None:
    """D aborts while the pull runs: D keeps the blocks kvd writes into until kvd reports
    the pull, then frees them; P is released by the read."""
    p = engines("prefill", daemons.prefill)
    d = engines("decode", daemons.decode)
    params = prefill(p, "req-5", PROMPT_TOKENS)
    d.add("dec-5", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
    d.step()
    assert d.status("dec-5") == "WAITING_FOR_REMOTE_KVS"
    blocks = d.block_ids("dec-5")
    reported = "dec-5" in d.received  # kvd may already have answered within that step
    d.abort("dec-5")
    if reported:
        assert d.num_free_blocks() == d.initial_free
    else:
        assert d.num_free_blocks() == d.initial_free - len(blocks), \
            "D freed blocks kvd may still be writing"
        assert "dec-5" in d.scheduler.requests
    drain([p, d])
    assert "dec-5" not in d.computed, "an aborted request was run"
    assert p.stat("sends_ok") == 1


def test_lease_expiry_releases_unread_prefill(daemons: Daemons, engines: MakeEngine) -> None:
    """No decode engine ever pulls: P gets its blocks back when the 1 s lease ends."""
    p = engines("prefill", daemons.prefill, lease_s=1.0)
    prefill(p, "req-6", PROMPT_TOKENS)
    # The publish leaves without waiting for the daemon: it is held soon after.
    run_until([], lambda: held(daemons.prefill, p), timeout_s=5, what="the publish held")
    start = time.monotonic()
    drain([p], timeout_s=15)
    elapsed = time.monotonic() - start
    assert 0.5 < elapsed < 15, elapsed
    assert p.stat("sends_expired") == 1 and p.stat("sends_ok") == 0
    assert not held(daemons.prefill, p)


# ------------------------------------------------------------------ load failures


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_daemon_killed_before_pull(policy: str, daemons: Daemons, engines: MakeEngine,
                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """The prefill daemon dies (SIGKILL) after publishing: vLLM's kv_load_failure_policy
    decides, "fail" ends the decode request with an error, "recompute" computes the whole
    prompt locally. P, whose daemon is gone, frees its blocks once lease + grace pass,
    and its steps never wait on the dead daemon (polls run off the step path)."""
    monkeypatch.setattr(kvd_vllm_scheduler, "SEND_GRACE_S", 1.0)
    victim = start_daemon(tmp_path, "victim", DAEMON_ARGS)
    try:
        p = engines("prefill", victim, lease_s=1.0, extra={"kvd_request_timeout_s": 1.0})
        d = engines("decode", daemons.decode, failure_policy=policy)
        params = prefill(p, "req-7", PROMPT_TOKENS)
        kill_daemon(victim)
        first_step_after_kill = len(p.step_s)

        d.add("dec-7", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
        run_until([p, d], lambda: d.finished("dec-7"), timeout_s=30, what="decode to end")
        assert d.received["dec-7"].failed
        assert d.stat("pulls_failed") == 1
        out = d.finished("dec-7")
        assert out is not None and out.finish_reason is not None
        if policy == "fail":
            assert out.finish_reason.name == "ERROR", out
            assert "dec-7" not in d.computed and generated(d, "dec-7") == []
        else:
            assert out.finish_reason.name == "LENGTH", out
            assert d.computed["dec-7"][0][0] == 0, "recompute must start at token 0"
            assert generated(d, "dec-7") == [SAMPLED_TOKEN] * 2
            bad = d.kv_mismatches(d.blocks_seen["dec-7"], 0, PROMPT, d.tag)
            assert bad == 0, "the recomputed prompt's KV is not D's own"
        drain([p, d], timeout_s=30)
        assert p.stat("sends_expired") == 1
        slowest = max(p.step_s[first_step_after_kill:])
        assert slowest < 0.5, f"a P step took {slowest:.2f} s with its daemon dead"
    finally:
        kill_daemon(victim)


# ------------------------------------------------------------------ many engines


def test_fan_out_two_decode_engines_read_one_prefill(daemons: Daemons,
                                                     engines: MakeEngine) -> None:
    """kvd_consumers=2: P holds its blocks until both decode engines (same decode request
    id, different engines) have read them; both get P's bytes."""
    p = engines("prefill", daemons.prefill)
    d1 = engines("decode1", daemons.decode)
    d2 = engines("decode2", daemons.decode)
    params = prefill(p, "req-8", PROMPT_TOKENS, {"kvd_consumers": 2})

    pull_to_decode(p, d1, params, "dec-8")
    check_pulled(d1, "dec-8", p, 0, PROMPT)
    run_until([p, d1], lambda: d1.finished("dec-8"), what="first decode to finish")
    drain([d1])
    assert "req-8" in p.scheduler.requests, "P released after one of two readers"
    [h] = held(daemons.prefill, p)
    assert (h.consumers_done, h.consumers) == (1, 2)

    d2.add("dec-8", PROMPT_TOKENS, max_tokens=3, kv_transfer_params=params)
    run_until([p, d2], lambda: "dec-8" in d2.received, what="second decode received")
    check_pulled(d2, "dec-8", p, 0, PROMPT)
    run_until([p, d2], lambda: d2.finished("dec-8"), what="second decode to finish")
    drain([p, d1, d2])
    assert p.stat("sends_ok") == 1


def test_same_request_id_on_two_prefill_engines(daemons: Daemons, engines: MakeEngine) -> None:
    """Two prefill engines each finish a request named "req-same"; one decode engine pulls
    both at once and each decode request gets its own prefill's bytes."""
    p1 = engines("prefill1", daemons.prefill)
    p2 = engines("prefill2", daemons.prefill)
    d = engines("decode", daemons.decode)
    prompt_a, prompt_b = prompt_tokens(11, PROMPT), prompt_tokens(12, PROMPT)
    params_a = prefill(p1, "req-same", prompt_a)
    params_b = prefill(p2, "req-same", prompt_b)
    assert params_a["remote_request_id"] == params_b["remote_request_id"] == "req-same"

    d.add("dec-a", prompt_a, max_tokens=2, kv_transfer_params=params_a)
    d.add("dec-b", prompt_b, max_tokens=2, kv_transfer_params=params_b)
    run_until([p1, p2, d], lambda: {"dec-a", "dec-b"} <= d.received.keys(),
              what="both pulls")
    check_pulled(d, "dec-a", p1, 0, PROMPT)
    check_pulled(d, "dec-b", p2, 0, PROMPT)
    run_until([p1, p2, d], lambda: d.finished("dec-a") and d.finished("dec-b"),
              what="both decodes to finish")
    drain([p1, p2, d])
    assert p1.stat("sends_ok") == 1 and p2.stat("sends_ok") == 1


# ------------------------------------------------------------------ heterogeneous engines
