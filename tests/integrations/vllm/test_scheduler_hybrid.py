"""A hybrid (Mamba + attention) model prefill -> decode through kvd, at scheduler level.

vLLM's real Scheduler with its hybrid allocator (two KV-cache groups: Mamba,
full attention), the worker-side KvdConnectors registering the hybrid rank
with real daemons and serving vLLM's one KV allocation from kvd's pool, and
two ``kvd serve`` processes moving the bytes (tests/integrations/vllm/hybrid_support.py).
Checked: the connector is SupportsHMA and publishes one block list per group;
the prefill engine stops one token short (the decode engine recomputes the
last prompt token on the Mamba state after N-1 tokens); the decode side
pulls one list per group and gets the attention K/V of every loaded token
and both Mamba states byte for byte; both schedulers drain.

The worker checks every vLLM view (attention pages in vLLM's LBHNC order,
Mamba slots) against kvd's hybrid layout at startup, unrelaxed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# Where vLLM is absent (.venv) the module skips before it imports vLLM's code.
pytest.importorskip("vllm", reason="no vLLM here; these tests run in .venv-vllm (README)")

from hybrid_support import (  # noqa: E402
    HybridEngine,
    make_hybrid_engine,
    transformers_family,
    write_model_dir,
)
from pd_support import closing_engines  # noqa: E402
from scheduler_support import (  # noqa: E402
    drain,
    prefill,
    prompt_tokens,
    run_until,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma  # noqa: E402

from kvd.integrations.vllm import KvdConnector  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.nixl]

PROMPT = 100  # tokens: 3 full attention blocks of 32 and a partial one
DAEMON_ARGS: list[str] = []  # the conftest's ``daemons`` with kvd's defaults

# The conftest's ``engines``, on the hybrid model.


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("hybrid-model"))


@pytest.fixture(scope="module")
def make_engine() -> Callable[..., HybridEngine]:
    return make_hybrid_engine


def test_connector_supports_hma() -> None:
    assert supports_hma(KvdConnector)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_hybrid_prefill_to_decode(daemons, engines, p_tp: int, d_tp: int) -> None:
    """Hetero TP too: a decode rank's Mamba state comes from one or two prefill ranks
    (x, B, C conv slices and SSM heads), its attention heads likewise."""
    pd, dd = daemons
    p = engines("hpre", pd, tp_size=p_tp)
    d = engines("hdec", dd, tp_size=d_tp)
    assert p.vllm_config.cache_config.get_resolved_kv_cache_layout().name == "LBHNC"
    assert [g.kv_cache_spec.__class__.__name__ for g in p.kv_cache_config.kv_cache_groups] \
        == ["MambaSpec", "FullAttentionSpec"]
    _prefill_to_decode(p, d)


@pytest.mark.parametrize("family", ["granitemoehybrid", "falcon_h1", "zamba2", "mamba2"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_family_prefill_to_decode(daemons, tmp_path: Path, family: str, p_tp: int,
                                  d_tp: int) -> None:
    """Granite 4.0-H (Mamba and attention layers), Falcon-H1 (both in every layer, the
    Mamba named "model.3.mixer"), Zamba2 (shared attention "model.attn.0", two Mamba
    groups with a slot each) and attention-free Mamba2, with the cache layer names
    vLLM's models give them and the Mamba specs of their own vLLM classes, hetero TP both
    ways: 16 SSM heads, 2 B/C groups and 2 or 4 KV heads split over 2 ranks."""
    pd, dd = daemons
    fam = transformers_family(family)
    model_dir = write_model_dir(tmp_path / family, fam)
    gen = closing_engines(make_hybrid_engine, model_dir)
    engines = next(gen)
    try:
        # attention-free: vLLM schedules in the Mamba block (a whole state per block)
        block = 2048 if family == "mamba2" else 64
        p = engines("fpre", pd, tp_size=p_tp, family=fam, block_size=block)
        d = engines("fdec", dd, tp_size=d_tp, family=fam, block_size=block)
        kinds = {g.kv_cache_spec.__class__.__name__ for g in p.kv_cache_config.kv_cache_groups}
        assert kinds == ({"MambaSpec"} if family == "mamba2"
                         else {"FullAttentionSpec", "MambaSpec"})
        _prefill_to_decode(p, d)
    finally:
        next(gen, None)


def _prefill_to_decode(p: HybridEngine, d: HybridEngine) -> None:
    prompt = prompt_tokens(11, PROMPT)
    params = prefill(p, "r1", prompt)
    loaded = PROMPT - 1  # the prefill engine stopped one token short (Mamba)
    assert params["remote_num_tokens"] == loaded
    groups = params["remote_block_ids"]
    if not isinstance(groups[0], list):  # one group (attention-free Mamba2) comes flat
        groups = [groups]
    for g, ids in enumerate(groups):  # Mamba: the running slot; attention: the blocks
        assert len(ids) == (1 if p.group_kind(g) == "mamba"
                            else -(-loaded // p.block_size)), groups
    assert p.computed["r1"][-1][1] == loaded

    d.add("r1", prompt, max_tokens=3, kv_transfer_params=params)
    run_until([p, d], lambda: "r1" in d.received, what="decode r1 to receive")
    got = d.received["r1"]
    assert not got.failed
    dgroups = got.block_ids
    if d.attn_layers:
        assert d.attn_mismatches(d.attn_blocks(dgroups), 0, loaded, p.tag, got.caches) == 0
    assert d.mamba_mismatches(dgroups, p.tag, loaded, got.caches) == 0
    # and the prefill engine's own state was what it published
    assert p.mamba_mismatches(groups, p.tag, loaded, p.caches) == 0
    run_until([p, d], lambda: d.finished("r1"), what="decode r1 to finish")
    # the decode engine computed only the last prompt token and its outputs
    assert d.computed["r1"][0] == (loaded, PROMPT)
    drain([p, d])


def test_hybrid_pull_of_unknown_request_fails_per_request(daemons, engines) -> None:
    """A multi-group pull that fails is reported per request (failed_recving): vLLM
    refuses block-level invalid ids for hybrid models."""
    pd, dd = daemons
    p = engines("hpre", pd)
    d = engines("hdec", dd)
    prompt = prompt_tokens(12, PROMPT)
    params = prefill(p, "r2", prompt)
    params["remote_request_id"] = "never-published"
    d.add("r2", prompt, max_tokens=2, kv_transfer_params=params)
    run_until([p, d], lambda: "r2" in d.received, what="decode r2's failed pull")
    assert d.received["r2"].failed
    run_until([p, d], lambda: d.finished("r2"), timeout_s=40, what="r2 to end")
    # The prefill's blocks stay held until the lease ends; abort nothing, just wait.
    run_until([p, d], lambda: not p.has_work(), timeout_s=60, what="prefill release")
    drain([p, d], timeout_s=60)
