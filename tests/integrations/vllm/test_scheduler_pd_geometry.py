"""Prefill -> decode through kvd with real vLLM schedulers, where the two engines differ:
block sizes (with and without a decode prefix hit), TP sizes, a hit that ends inside a
prefill block; and vLLM's sleep mode, which kvd refuses. Same harness as
test_scheduler_pd.py (pd_support, scheduler_support): real daemons, bytes checked per
rank, both schedulers drained at the end of every case.
"""

from __future__ import annotations

import copy

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from pd_support import (  # noqa: E402
    PROMPT,
    PROMPT_TOKENS,
    Daemons,
    MakeEngine,
    block_nbytes,
    check_pulled,
    n_blocks,
    pull_to_decode,
)
from scheduler_support import (  # noqa: E402
    drain,
    prefill,
    run_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

# The shared fixtures (module-scoped daemons: each module gets its own pair).


@pytest.mark.parametrize(("p_block", "d_block"), [(32, 64), (64, 32)])
def test_block_size_ratio(p_block: int, d_block: int, daemons: Daemons,
                          engines: MakeEngine) -> None:
    """Prefill and decode engines with different block sizes: kvd places each token."""
    p = engines("prefill", daemons.prefill, block_size=p_block)
    d = engines("decode", daemons.decode, block_size=d_block)
    params = prefill(p, "req-9", PROMPT_TOKENS)
    assert len(params["remote_block_ids"]) == n_blocks(PROMPT, p_block)
    pull_to_decode(p, d, params, "dec-9")
    check_pulled(d, "dec-9", p, 0, PROMPT)
    got = d.received["dec-9"]
    assert d.nonzero_outside(got.block_ids[:n_blocks(PROMPT, d_block)], got.caches) == 0
    run_until([p, d], lambda: d.finished("dec-9"), what="decode to finish")
    drain([p, d])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_tensor_parallel_sizes_differ(p_tp: int, d_tp: int, daemons: Daemons,
                                      engines: MakeEngine) -> None:
    """TP1 -> TP2 (and back): every registered rank of the reading engine gets exactly its
    own heads of every token (checked per rank)."""
    p = engines("prefill", daemons.prefill, tp_size=p_tp)
    d = engines("decode", daemons.decode, tp_size=d_tp)
    assert len(p.workers) == p_tp and len(d.workers) == d_tp
    with daemons.decode.client(ping_interval_s=0) as c:
        ranks = [e for e in c.status().engines if e.engine_id == d.engine_id]
    assert len(ranks) == d_tp, ranks
    params = prefill(p, "req-10", PROMPT_TOKENS)
    pull_to_decode(p, d, params, "dec-10")
    check_pulled(d, "dec-10", p, 0, PROMPT)
    run_until([p, d], lambda: d.finished("dec-10"), what="decode to finish")
    drain([p, d])


@pytest.mark.parametrize(("p_block", "d_block", "hit"), [(32, 64, 64), (64, 32, 64)])
def test_block_size_ratio_with_prefix_hit(p_block: int, d_block: int, hit: int,
                                          daemons: Daemons, engines: MakeEngine) -> None:
    """Different block sizes and a local prefix hit on D: only the tail is read, into the
    right slots, and D's cached prefix keeps its own bytes."""
    p = engines("prefill", daemons.prefill, block_size=p_block)
    d = engines("decode", daemons.decode, block_size=d_block)
    d.add("warm", PROMPT_TOKENS[:hit + 1], max_tokens=1)  # caches tokens [0, hit)
    run_until([d], lambda: d.finished("warm"), what="warm-up")
    drain([d])
    params = prefill(p, "req-11", PROMPT_TOKENS)
    pull_to_decode(p, d, params, "dec-11")
    got = d.received["dec-11"]
    assert not got.failed
    assert d.kv_mismatches(got.block_ids, 0, hit, d.tag, got.caches) == 0
    check_pulled(d, "dec-11", p, hit, PROMPT)
    assert d.stat("nbytes") == (n_blocks(PROMPT, d_block) - hit // d_block) * block_nbytes(d)
    run_until([p, d], lambda: d.finished("dec-11"), what="decode to finish")
    assert d.computed["dec-11"][0] == (PROMPT - 1, PROMPT)
    drain([p, d])


def test_prefix_hit_inside_a_larger_prefill_block_computes_the_tail(
        daemons: Daemons, engines: MakeEngine) -> None:
    """P blocks of 64, D blocks of 32, D caches 32 tokens: kvd cannot continue a hit
    from the middle of a prefill block, so D computes the tail itself (no failed
    request, whatever the failure policy) and a notify-only pull releases P at once."""
    p = engines("prefill", daemons.prefill, block_size=64, lease_s=30.0)
    d = engines("decode", daemons.decode, block_size=32)
    d.add("warm", PROMPT_TOKENS[:33], max_tokens=1)  # caches tokens [0, 32)
    run_until([d], lambda: d.finished("warm"), what="warm-up")
    drain([d])
    params = prefill(p, "req-12", PROMPT_TOKENS)
    assert params["kvd_block_size"] == 64
    d.add("dec-12", PROMPT_TOKENS, max_tokens=2, kv_transfer_params=params)
    run_until([p, d], lambda: d.finished("dec-12") and not p.has_work(), timeout_s=10,
              what="decode to finish and P to be released")
    out = d.finished("dec-12")
    assert out is not None and out.finish_reason is not None
    assert out.finish_reason.name == "LENGTH", out
    assert "dec-12" not in d.received and d.stat("nbytes") == 0
    assert d.computed["dec-12"][0] == (32, PROMPT)
    drain([p, d])
    assert p.stat("sends_ok") == 1


# ------------------------------------------------------------------ sleep mode


def test_sleep_mode_refused(daemons: Daemons, engines: MakeEngine) -> None:
    """kvd owns the KV pool, so vLLM's sleep mode is refused. With enable_sleep_mode the
    connector refuses to start (and vLLM 0.33 refuses the config itself, having asked
    ``supports_sleep_mode``). vLLM 0.33's sleep and KV discard call
    ``unregister_kv_caches`` first, even without enable_sleep_mode: it raises before any
    memory is touched, and the engine then still hands off as before."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvd.integrations.vllm import VLLM_VERSION, KvdConnector

    p = engines("prefill", daemons.prefill)
    d = engines("decode", daemons.decode)
    assert KvdConnector.supports_sleep_mode(p.vllm_config.kv_transfer_config) is False

    sleepy = copy.copy(p.vllm_config)
    sleepy.model_config = copy.copy(p.vllm_config.model_config)
    sleepy.model_config.enable_sleep_mode = True
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="does not support vLLM sleep mode"):
            KvdConnector(sleepy, role, p.kv_cache_config)
    if not VLLM_VERSION.startswith("0.32."):
        with pytest.raises(ValueError, match="KvdConnector does not support sleep mode"):
            sleepy._verify_kv_transfer_compat()  # what VllmConfig runs when it is built

    for w in p.workers + d.workers:
        with pytest.raises(RuntimeError, match="does not support vLLM sleep mode"):
            w.unregister_kv_caches()
        w.restore_kv_caches()  # wake-up: nothing to redo
    params = prefill(p, "req-13", PROMPT_TOKENS)
    pull_to_decode(p, d, params, "dec-13")
    check_pulled(d, "dec-13", p, 0, PROMPT)
    run_until([p, d], lambda: d.finished("dec-13"), what="decode to finish")
    drain([p, d])
