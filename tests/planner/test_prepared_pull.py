"""kvd.planner.assembly.PreparedPull: a pull's assembly inputs bound once per
(engine, peer engine), one-block pulls served from ready templates. It must give exactly
what ``assemble_pull`` gives (same groups, same order, same descriptors, same refusals),
for any layout, parallelism, owner split and block pair, and the consumer must rebuild it
when a pool or the handshake changes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planner_cases import pulls, rank_pools

from kvd.errors import BlockIdError, LayoutError
from kvd.planner import plan_transfer
from kvd.planner.assembly import (
    SMALL_DESCRIPTORS,
    ProducerReads,
    assemble_pull,
    match_tail,
    prepare_pull,
)
from kvd.pool.geometry import geometry, parallelism
from kvd.tools.sim import EngineShape
from kvd.wire.protocol import ModelSpec


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)  # one READ per producer, in the same order
    for owner, g in got.items():
        w = want[owner]
        assert (g.owner, g.reads, g.descriptors, g.total_nbytes) == (
            w.owner, w.reads, w.descriptors, w.total_nbytes)
        for col in ("local_addrs", "remote_addrs", "nbytes", "local_devs", "remote_devs"):
            assert np.array_equal(getattr(g, col), getattr(w, col)), col


def _outcome(fn):
    try:
        return fn(), None
    except LayoutError as exc:
        return None, str(exc)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pulls(), st.integers(1, 2), st.data())
def test_prepared_pull_assembles_what_assemble_pull_does(case, owners, data) -> None:
    model, pshape, dshape, tokens, _, p_ids, d_ids = case
    _, pranks = rank_pools(model, pshape, owners)
    _, dranks = rank_pools(model, dshape)
    plan = plan_transfer(geometry(model), parallelism(pshape.tp_size, pshape.pp_size, None),
                         parallelism(dshape.tp_size, dshape.pp_size, None))
    local = [pool for _, pool, _ in dranks]
    remote = {rid: pool for rid, pool, _ in pranks}
    names = [f"agent{i}" for i in range(owners)] + ["idle"]
    prepared = prepare_pull(plan, local, remote, names)
    pulls_to_try = [match_tail(d_ids, p_ids, dshape.block_size_tokens,
                               pshape.block_size_tokens, tokens)]
    # one-block pulls, in range or not (the fast path), drawn on both sides
    for _ in range(3):
        lid = data.draw(st.integers(-1, dshape.num_blocks))
        rid = data.draw(st.integers(-1, pshape.num_blocks))
        pulls_to_try.append((np.array([lid]), np.array([rid])))
        pulls_to_try.append(([lid], [rid]))  # as a Pull message carries them
    for lo, ro in pulls_to_try:
        got, got_err = _outcome(lambda lo=lo, ro=ro: prepared.assemble(lo, ro))
        want, want_err = _outcome(
            lambda lo=lo, ro=ro: assemble_pull(plan, local, remote, lo, ro, names))
        assert got_err == want_err
        if want is not None:
            _same(got, want)


def test_prepared_pull_takes_one_block_pulls_from_its_templates() -> None:
    """The fast path is taken (no planning per pull) where every read has a template."""
    model = ModelSpec(name="t", num_kv_heads=2, num_layers=2, head_dim=4, dtype="bfloat16")
    shape = EngineShape(1, 1, 4, 8, "head_major", "HND")
    _, pranks = rank_pools(model, shape)
    _, dranks = rank_pools(model, shape)
    plan = plan_transfer(geometry(model), parallelism(1, 1, None), parallelism(1, 1, None))
    prepared = prepare_pull(plan, [p for _, p, _ in dranks], {r: p for r, p, _ in pranks},
                            ["agent0"])
    assert prepared.rows is not None and prepared.local_blocks == 8
    groups = prepared.assemble(np.array([3]), np.array([5]))
    want = assemble_pull(plan, [p for _, p, _ in dranks], {r: p for r, p, _ in pranks},
                         np.array([3]), np.array([5]), ["agent0"])
    _same(groups, want)
    # a few descriptors stay tuples of Python ints (no numpy on a one-block pull's path)
    for col in ("local_addrs", "remote_addrs", "nbytes", "local_devs", "remote_devs"):
        got = getattr(groups["agent0"], col)
        assert type(got) is tuple and all(type(x) is int for x in got), col
    # the ready rows are shared between pulls: nobody may write into them
    assert not prepared.rows[0].nbytes.flags.writeable
    with pytest.raises(LayoutError, match="out of range"):
        prepared.assemble(np.array([8]), np.array([0]))


@pytest.mark.parametrize("ids", [[-2], [3, -1, 4], [1, 2, 3, 4, 5, 6, 7, 8, -9]])
def test_small_id_lists_still_name_negative_ids(ids) -> None:
    """The small-list check (Python's min instead of numpy's) refuses what numpy did."""
    with pytest.raises(BlockIdError, match="negative"):
        match_tail(ids, [0] * len(ids), 16, 16)
    with pytest.raises(BlockIdError, match="negative"):
        match_tail([0] * len(ids), ids, 16, 16)


def test_tuple_columns_become_one_array_past_a_few_descriptors() -> None:
    """Parts given as tuples concatenate as tuples up to SMALL_DESCRIPTORS, and as one
    int64 array past it or mixed with an array: the same values either way."""
    small = ProducerReads("a")
    for i in range(2):
        small.add_rows((10 + i,), (20 + i,), (4,), (0,), (0,))
    assert small.local_addrs == (10, 11) and small.total_nbytes == 8
    big = ProducerReads("a")
    for i in range(SMALL_DESCRIPTORS + 1):
        big.add_rows((10 + i,), (20 + i,), (4,), (0,), (0,))
    assert isinstance(big.local_addrs, np.ndarray) and big.local_addrs.dtype == np.int64
    assert big.local_addrs.tolist() == list(range(10, 11 + SMALL_DESCRIPTORS))
    mixed = ProducerReads("a")
    mixed.add_rows((1,), (2,), (4,), (0,), (0,))
    mixed.add_rows(np.array([5]), np.array([6]), np.array([8]), np.array([0]), np.array([0]))
    assert mixed.nbytes.tolist() == [4, 8] and mixed.total_nbytes == 12


def _canon(local, remote, nbytes) -> list[tuple[int, int, int]]:
    """Descriptors as the byte map they stand for: sorted by local address, runs that
    are adjacent on both sides merged (any cut of the same bytes gives the same list)."""
    rows = sorted(zip(np.asarray(local).tolist(), np.asarray(remote).tolist(),
                      np.asarray(nbytes).tolist(), strict=True))
    out: list[list[int]] = []
    for a, b, n in rows:
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1][2] += n
        else:
            out.append([a, b, n])
    return [tuple(r) for r in out]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pulls(), st.integers(1, 2))
def test_a_pull_as_block_ids_moves_what_assemble_pull_does(case, owners) -> None:
    """Oracle: assemble_pull. The block form (each producer's table shifted per block
    pair) stands for the same bytes, byte for byte; the deferred columns are
    assemble_pull's own; reads, totals and refusals are the same."""
    model, pshape, dshape, tokens, _, p_ids, d_ids = case
    _, pranks = rank_pools(model, pshape, owners)
    _, dranks = rank_pools(model, dshape)
    plan = plan_transfer(geometry(model), parallelism(pshape.tp_size, pshape.pp_size, None),
                         parallelism(dshape.tp_size, dshape.pp_size, None))
    local = [pool for _, pool, _ in dranks]
    remote = {rid: pool for rid, pool, _ in pranks}
    names = [f"agent{i}" for i in range(owners)] + ["idle"]
    prepared = prepare_pull(plan, local, remote, names)
    lo, ro = match_tail(d_ids, p_ids, dshape.block_size_tokens, pshape.block_size_tokens,
                        tokens)
    got, got_err = _outcome(lambda: prepared.assemble(lo, ro, blocks=True))
    want, want_err = _outcome(lambda: assemble_pull(plan, local, remote, lo, ro, names))
    assert got_err == want_err
    if want is None:
        return
    equal_blocks = pshape.block_size_tokens == dshape.block_size_tokens
    assert (prepared.tables is not None) == (equal_blocks and prepared.rows is not None)
    for owner, w in want.items():
        g = got[owner]
        assert (g.owner, g.reads, g.total_nbytes) == (w.owner, w.reads, w.total_nbytes)
        if g.blocks is None:
            assert not (prepared.tables and w.descriptors and len(lo) >= 1)
            continue
        d, s, n, dd, sd = g.blocks.expand()
        assert _canon(d, s, n) == _canon(w.local_addrs, w.remote_addrs, w.nbytes)
        assert set(dd.tolist()) == set(np.asarray(w.local_devs).tolist())
        assert set(sd.tolist()) == set(np.asarray(w.remote_devs).tolist())
    for g in got.values():  # counted as the copier moves them: blocks x table rows
        assert g.blocks is None or g.descriptors == g.blocks.descriptors
    for g in got.values():
        g.built_column(0)  # then assemble_pull's own, its count included
    _same(got, want)


def test_block_form_hands_over_ids_without_building_descriptors(monkeypatch) -> None:
    """A multi-block pull with blocks=True builds no descriptor until one is asked for;
    one-block pulls carry their block pair too."""
    import kvd.planner.assembly as assembly

    model = ModelSpec(name="t", num_kv_heads=4, num_layers=3, head_dim=8, dtype="bfloat16")
    shape = EngineShape(1, 1, 4, 64, "kv_split", "HND")
    _, pranks = rank_pools(model, shape)
    _, dranks = rank_pools(model, EngineShape(2, 1, 4, 64, "kv_split", "HND"))
    plan = plan_transfer(geometry(model), parallelism(1, 1, None), parallelism(2, 1, None))
    prepared = prepare_pull(plan, [p for _, p, _ in dranks], {r: p for r, p, _ in pranks},
                            ["agent0"])
    want = prepared.assemble(np.arange(40), np.arange(40)[::-1].copy())

    def refuse(*a, **k):
        raise AssertionError("descriptors built")

    monkeypatch.setattr(assembly, "build_read_descriptors", refuse)
    groups = prepared.assemble(np.arange(40), np.arange(40)[::-1].copy(), blocks=True)
    g = groups["agent0"]
    assert g.blocks is not None and g.blocks.blocks == 40
    assert g.total_nbytes == want["agent0"].total_nbytes
    assert g.blocks.table is prepared.tables["agent0"]  # prepared once, shared
    with pytest.raises(AssertionError, match="descriptors built"):
        np.asarray(g.local_addrs)  # asked for: built then (by assemble_pull)
    monkeypatch.undo()
    assert np.array_equal(np.asarray(g.local_addrs), want["agent0"].local_addrs)
    one = prepared.assemble([5], [9], blocks=True)["agent0"]
    assert (tuple(one.blocks.dst_ids), tuple(one.blocks.src_ids)) == ((5,), (9,))
    assert prepared.assemble([5], [9])["agent0"].blocks is None
