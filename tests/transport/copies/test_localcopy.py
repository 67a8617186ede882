"""LocalCopier and its plan: byte-exact against a numpy oracle, every failure path,
and the split between copy threads."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.errors import BusyError, TransferError
from kvd.transport.copies import localcopy
from kvd.transport.copies.copyplan import plan_copy
from kvd.transport.copies.localcopy import LocalCopier, memmove_copy
from kvd.transport.copies.nativecopy import build, load_batch_copy

MIB = 1 << 20
BUF = 1 << 18


@st.composite
def copies(draw, buf: int = BUF):
    """Descriptors into a ``buf``-byte destination (no two overlapping) from a ``buf``-byte
    source (overlaps allowed: reading a byte twice is fine), with runs adjacent on both
    sides now and then so that merging is exercised."""
    sizes = draw(st.lists(st.integers(1, 9000), min_size=1, max_size=40))
    starts = np.cumsum([0] + sizes[:-1])
    keep = [i for i, s in enumerate(starts) if s + sizes[i] <= buf]
    if not keep:
        keep = [0]
        sizes[0] = min(sizes[0], buf)
    order = draw(st.permutations(keep))
    order = order[:draw(st.integers(1, len(order)))]
    dst, src, nbytes = [], [], []
    for i in order:
        n = sizes[i]
        follow = (draw(st.booleans()) and src and dst[-1] + nbytes[-1] == starts[i]
                  and src[-1] + nbytes[-1] + n <= buf)
        src.append(src[-1] + nbytes[-1] if follow else draw(st.integers(0, buf - n)))
        dst.append(int(starts[i]))
        nbytes.append(n)
    return np.array(dst), np.array(src), np.array(nbytes)


def oracle(dst: np.ndarray, src: np.ndarray, d_off, s_off, nbytes) -> np.ndarray:
    out = dst.copy()
    for d, s, n in zip(d_off.tolist(), s_off.tolist(), nbytes.tolist(), strict=True):
        out[d:d + n] = src[s:s + n]
    return out


def byte_map(dst, src, nbytes) -> dict[int, int]:
    """destination byte -> source byte, for a plan or a descriptor list."""
    out: dict[int, int] = {}
    for d, s, n in zip(np.asarray(dst).tolist(), np.asarray(src).tolist(),
                       np.asarray(nbytes).tolist(), strict=True):
        for k in range(n):
            assert d + k not in out, "a destination byte written twice"
            out[d + k] = s + k
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desc=copies(buf=1 << 14), parts=st.integers(1, 5), align=st.sampled_from([1, 64, 512]),
       max_piece=st.integers(1, 5000))
def test_plan_moves_every_byte_once_and_splits_evenly(desc, parts, align, max_piece):
    d, s, n = desc
    plan = plan_copy(d, s, n, parts=parts, min_part_nbytes=align, max_piece_nbytes=max_piece,
                     align=align)
    total = int(n.sum())
    assert plan.total == total and plan.descriptors == len(n)
    got = byte_map(np.concatenate([p.dst for p in plan.parts]),
                   np.concatenate([p.src for p in plan.parts]),
                   np.concatenate([p.nbytes for p in plan.parts]))
    assert got == byte_map(d, s, n)
    want_parts = max(1, min(parts, total // align))
    assert len(plan.parts) == want_parts
    for p in plan.parts:
        assert abs(p.total - total / want_parts) < 2 * align
        assert (p.nbytes <= max_piece).all()


def primitive_or_skip(primitive: str) -> str:
    if primitive == "native" and load_batch_copy() is None:
        pytest.skip("no C compiler: the batched memcpy cannot be built here")
    return primitive


@pytest.mark.parametrize("primitive", ["memmove", "native"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desc=copies(), threads=st.integers(1, 3), inline=st.sampled_from([0, 4096, MIB]),
       max_piece=st.sampled_from([1000, 4096, 1 << 16]))
def test_copier_is_byte_exact(primitive, desc, threads, inline, max_piece):
    primitive_or_skip(primitive)
    rng = np.random.default_rng(int(desc[2].sum()))
    src = rng.integers(0, 256, BUF, dtype=np.uint8)
    dst = rng.integers(0, 256, BUF, dtype=np.uint8)
    want = oracle(dst, src, *desc)
    d, s, n = desc
    with LocalCopier(threads=threads, inline_max_nbytes=inline, max_piece_nbytes=max_piece,
                     primitive=primitive) as c:
        assert c.primitive == primitive
        h = c.post((d + dst.ctypes.data).astype(np.uint64),
                   (s + src.ctypes.data).astype(np.uint64), n.astype(np.uint64))
        assert c.wait(h, timeout_s=30)
        c.release(h)
        assert c.counts().handles == 0
    np.testing.assert_array_equal(dst, want)


@pytest.mark.parametrize("primitive", ["memmove", "native"])
def test_fragmented_blocks_land_byte_exact_on_two_threads(primitive):
    """2 MiB blocks with shuffled ids on both sides, 32 MiB, against the oracle."""
    primitive_or_skip(primitive)
    rng = np.random.default_rng(7)
    blocks = 16
    src = rng.integers(0, 256, blocks * 2 * MIB, dtype=np.uint8)
    dst = np.zeros_like(src)
    d = rng.permutation(blocks) * 2 * MIB
    s = rng.permutation(blocks) * 2 * MIB
    n = np.full(blocks, 2 * MIB)
    with LocalCopier(threads=2, primitive=primitive) as c:
        h = c.post(d + dst.ctypes.data, s + src.ctypes.data, n)
        assert c.wait(h, timeout_s=30)
        c.release(h)
    np.testing.assert_array_equal(dst, oracle(np.zeros_like(src), src, d, s, n))


class Recorder:
    """A copy primitive that copies nothing and records who was asked for what."""

    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None):
        self.calls: list[tuple[str, int, int, int]] = []
        self.gate = gate
        self.fail_at = fail_at
        self.started = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, dst: int, src: int, nbytes: int) -> None:
        with self._lock:
            self.calls.append((threading.current_thread().name, dst, src, nbytes))
            count = len(self.calls)
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail_at is not None and count >= self.fail_at:
            raise OSError("injected copy failure")


def test_threads_share_bytes_evenly():
    """Shuffled 2 MiB blocks and TP1->TP2 128 KiB head halves (512 MiB each), on 2 and
    3 copy threads: each thread gets total/threads bytes within one alignment unit."""
    rng = np.random.default_rng(3)
    frag = (rng.permutation(256) * 2 * MIB + (1 << 40), rng.permutation(256) * 2 * MIB,
            np.full(256, 2 * MIB))
    b = np.repeat(np.arange(2048), 2)
    h = np.tile([0, 1], 2048)
    sliced = (h * (256 * MIB) + rng.permutation(2048)[b] * (128 << 10) + (1 << 40),
              b * (256 << 10) + h * (128 << 10), np.full(4096, 128 << 10))
    for desc in (frag, sliced):
        for threads in (2, 3):
            rec = Recorder()
            with LocalCopier(threads=threads, copy_fn=rec) as c:
                handle = c.post(*desc)
                assert c.wait(handle, timeout_s=30)
                c.release(handle)
            per_thread = Counter()
            for name, _, _, n in rec.calls:
                per_thread[name] += n
            assert sum(per_thread.values()) == 512 * MIB
            # Every thread took one share (a thread may take two if another was slow
            # to wake: the shares themselves are what must be even).
            plan = c.last_plan
            assert len(plan.parts) == threads
            for part in plan.parts:
                assert abs(part.total - 512 * MIB / threads) < 4096


def test_small_copy_is_done_inline_on_the_caller_thread():
    src = np.arange(64 << 10, dtype=np.uint8)
    dst = np.zeros_like(src)
    rec_calls = []

    def copy(d, s, n):
        rec_calls.append(threading.current_thread().name)
        memmove_copy(d, s, n)

    with LocalCopier(threads=1, copy_fn=copy) as c:
        h = c.post(np.array([dst.ctypes.data]), np.array([src.ctypes.data]),
                   np.array([src.nbytes]))
        assert c.poll(h) is True
        c.release(h)
    assert rec_calls == [threading.current_thread().name]
    np.testing.assert_array_equal(dst, src)


def test_an_inline_copy_of_many_descriptors_is_one_batch_call_without_a_plan(monkeypatch):
    """A local pull's copy (a 3.2 MB, 200-descriptor copy: one hand-over of the tiny
    Llama) runs inside post() as one batched memcpy call: planning it (merging, cutting
    into shares and pieces) cost a quarter of the copy."""
    if load_batch_copy() is None:
        pytest.skip("no C compiler: the batched memcpy is not built here")
    block, pieces, blocks = 128 << 10, 8, 25
    src = np.arange(64 * block, dtype=np.uint8) % 251
    dst = np.zeros_like(src)
    rng = np.random.default_rng(3)
    sb, db = (np.sort(rng.choice(64, blocks, replace=False)) for _ in range(2))
    step = block // pieces
    offs = np.arange(pieces) * step
    s = (src.ctypes.data + sb[:, None] * block + offs).reshape(-1)
    d = (dst.ctypes.data + db[:, None] * block + offs).reshape(-1)
    n = np.full(len(s), step)

    def no_plan(*a, **k):
        raise AssertionError("an inline copy was planned")

    monkeypatch.setattr(localcopy, "plan_copy", no_plan)
    with LocalCopier(threads=2, inline_max_nbytes=4 * MIB) as c:
        calls = []
        batch = c._batch
        c._batch = lambda *a: (calls.append(len(a[2])), batch(*a))
        regions = {"dst_regions": [(dst.ctypes.data, dst.nbytes)],
                   "src_regions": [(src.ctypes.data, src.nbytes)]}
        h = c.post(d, s, n, **regions)
        assert c.poll(h) is True  # ended inside post()
        c.release(h)
        assert calls == [blocks * pieces]
        for sbi, dbi in zip(sb, db, strict=True):
            np.testing.assert_array_equal(dst[dbi * block:(dbi + 1) * block],
                                          src[sbi * block:(sbi + 1) * block])
        # the pools are still checked: a descriptor outside them is refused, nothing copied
        with pytest.raises(TransferError, match="outside"):
            c.post(d + dst.nbytes, s, n, **regions)
        with pytest.raises(ValueError, match="overlap"):
            c.post(np.full(len(s), dst.ctypes.data), s, n)
        assert calls == [blocks * pieces] and c.counts().handles == 0


def test_unknown_and_released_handles_raise():
    with LocalCopier() as c:
        with pytest.raises(TransferError, match="unknown"):
            c.poll(12345)
        with pytest.raises(TransferError, match="unknown"):
            c.release(12345)
        buf = np.zeros(8192, dtype=np.uint8)
        h = c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [4096])
        c.release(h)
        with pytest.raises(TransferError, match="unknown"):
            c.poll(h)


@pytest.mark.parametrize("inline", [0, MIB])
def test_a_failed_copy_raises_on_poll(inline):
    rec = Recorder(fail_at=1)
    with LocalCopier(threads=1, copy_fn=rec, inline_max_nbytes=inline,
                     max_piece_nbytes=4096) as c:
        h = c.post([1 << 40], [1 << 41], [4 * 4096])
        c._get(h).ended.wait(10)
        with pytest.raises(TransferError, match="injected copy failure"):
            c.poll(h)
        c.release(h)
        assert c.counts() == type(c.counts())(handles=0, running=0, queued_parts=0)


def test_release_before_done_waits_and_abandons_the_rest():
    """A running copy's release waits (or raises, keeping the handle) and no piece not
    yet started runs after it: memory handed back is never written."""
    gate = threading.Event()
    rec = Recorder(gate=gate)
    with LocalCopier(threads=1, copy_fn=rec, max_piece_nbytes=4096, inline_max_nbytes=0) as c:
        h = c.post([1 << 40], [1 << 41], [64 * 4096])
        assert rec.started.wait(10)
        assert c.poll(h) is False
        with pytest.raises(TransferError, match="still running"):
            c.release(h, timeout_s=0.05)
        assert c.counts().handles == 1  # kept: the caller must keep the memory too
        gate.set()
        c.release(h)
        assert c.counts().handles == 0
        assert len(rec.calls) < 64  # the pieces not started were abandoned


def test_release_of_a_queued_copy_never_runs_it():
    gate = threading.Event()
    rec = Recorder(gate=gate)
    with LocalCopier(threads=1, copy_fn=rec, inline_max_nbytes=0) as c:
        first = c.post([1 << 40], [1 << 41], [4096])
        assert rec.started.wait(10)
        second = c.post([2 << 40], [2 << 41], [4096])
        c.release(second)  # queued behind the first: dropped, returns at once
        gate.set()
        assert c.wait(first, timeout_s=10)
        c.release(first)
    assert [call[1] for call in rec.calls] == [1 << 40]


def test_bad_descriptors_are_refused_with_nothing_left_behind():
    buf = np.zeros(1 << 16, dtype=np.uint8)
    base = buf.ctypes.data
    with LocalCopier() as c:
        with pytest.raises(ValueError, match="overlap"):
            c.post([base, base + 100], [base, base], [200, 200])
        with pytest.raises(ValueError, match="overlap"):
            c.post(np.arange(20) * 10 + base, np.arange(20) * 10 + base, np.full(20, 11))
        with pytest.raises(ValueError, match="sizes"):
            c.post([base], [base, base], [1])
        with pytest.raises(ValueError, match="> 0"):
            c.post([base], [base], [0])
        with pytest.raises(TransferError, match="outside the source pool"):
            c.post([base], [base + (1 << 16)], [16], src_regions=[(base, 1 << 16)],
                   dst_regions=[(base, 1 << 16)])
        with pytest.raises(TransferError, match="outside the destination pool"):
            c.post(np.arange(20) * 4096 + base, np.arange(20) * 4096 + base,
                   np.full(20, 4096), dst_regions=[(base, 1 << 16)])
        assert c.counts().handles == 0


def test_bounded_handles_and_closed_copier():
    buf = np.zeros(8192, dtype=np.uint8)
    c = LocalCopier(max_handles=2)
    a = c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [16])
    c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [16])
    with pytest.raises(BusyError):
        c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [16])
    c.release(a)
    c.close()
    with pytest.raises(TransferError, match="closed"):
        c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [16])


def test_close_abandons_queued_copies():
    gate = threading.Event()
    rec = Recorder(gate=gate)
    c = LocalCopier(threads=1, copy_fn=rec, inline_max_nbytes=0)
    first = c.post([1 << 40], [1 << 41], [4096])
    assert rec.started.wait(10)
    second = c.post([2 << 40], [2 << 41], [4096])
    threading.Timer(0.05, gate.set).start()
    c.close()
    assert c.poll(first) is True
    with pytest.raises(TransferError, match="closed"):
        c.poll(second)
    assert len(rec.calls) == 1


def test_native_copy_builds_once_per_source_and_falls_back_without_a_compiler(tmp_path):
    if load_batch_copy() is None:
        pytest.skip("no C compiler here")
    lib = build(tmp_path / "a", "cc")
    assert lib.name.startswith("libkvd_memcpy_batch-") and lib.exists()
    mtime = lib.stat().st_mtime_ns
    assert build(tmp_path / "a", "cc") == lib and lib.stat().st_mtime_ns == mtime
    assert not [p for p in lib.parent.iterdir() if p.name.startswith(".build-")]
    fn = load_batch_copy(str(tmp_path / "a"), "cc")
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros_like(src)
    fn(np.array([dst.ctypes.data, dst.ctypes.data + 2048]),
       np.array([src.ctypes.data + 2048, src.ctypes.data]), np.array([2048, 2048]))
    np.testing.assert_array_equal(dst, np.concatenate([src[2048:], src[:2048]]))
    with pytest.raises(ValueError, match="int64"):
        fn(np.array([1], dtype=np.uint32), np.array([1]), np.array([1]))

    missing = str(tmp_path / "no-such-cc")
    assert load_batch_copy(str(tmp_path / "b"), missing) is None
    assert not (tmp_path / "b").exists() or not list((tmp_path / "b").glob("*.so"))


def test_copier_without_a_compiler_uses_memmove_or_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("KVD_NATIVE_DIR", str(tmp_path / "native"))
    with LocalCopier(primitive="auto") as c:
        assert c.primitive == "memmove"
        buf = np.arange(8192, dtype=np.uint8)
        h = c.post([buf.ctypes.data], [buf.ctypes.data + 4096], [4096])
        assert c.poll(h)
        c.release(h)
        np.testing.assert_array_equal(buf[:4096], buf[4096:])
    with pytest.raises(TransferError, match="could not be built"):
        LocalCopier(primitive="native")
