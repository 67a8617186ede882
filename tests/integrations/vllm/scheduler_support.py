"""vLLM's real scheduler and kvd's worker connectors in one process, against real daemons.

Why this exists: vLLM's own scheduler-test helpers (``create_vllm_config``,
``create_scheduler``, ``create_request``, ``create_model_runner_output``,
``assert_scheduler_empty``) are not shipped in the wheel, and a whole engine
per case costs ~30 s of startup. Here each "engine" is vLLM's
``vllm.v1.core.sched.scheduler.Scheduler`` (with the ``KvdConnector`` it builds
itself from the kv_transfer_config) plus one worker-role ``KvdConnector`` per
TP rank, whose KV cache vLLM's own ``allocate_kv_cache`` carves out of kvd's shm
pool. ``SimEngine.step`` does what vLLM's engine core and model runner do
around the connector each step; the forward pass is replaced by writing a
known KV pattern into the scheduled tokens' slots, so a pull can be checked
byte for byte on the decode side.

The KV pattern of a token is a hash of (tag, layer, position, global head,
channel): ``tag`` names who computed it (each engine has its own), so a
decode block shows whether its bytes were pulled from the prefill engine or
computed locally, and a TP2 rank shows whether it got its own heads.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from kvd.integrations.vllm import KvdConnector
from kvd.pool.shm import SHM_DIR, kvd_segments
from kvd.tools.localcluster import DaemonProcess

# ------------------------------------------------------------------ the model

NUM_LAYERS = 2
NUM_KV_HEADS = 4  # TP2 gives each rank 2 heads, so "each rank got its own heads" is testable
HEAD_DIM = 64  # CPU attention refuses 16; 64 is the smallest common size it takes
SAMPLED_TOKEN = 7  # what the fake model samples; not EOS (2), so max_tokens ends requests
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS))
DTYPE = torch.float32  # 4-byte elements: the int32 pattern is written through a bit view

MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": NUM_KV_HEADS * HEAD_DIM,
    "intermediate_size": 512,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": NUM_KV_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model_dir(path: Path) -> Path:
    """A config-only Llama directory: the scheduler needs the shapes, never weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    return path


# ------------------------------------------------------------------ daemons


def start_daemon(log_dir: Path, role: str, extra_args: list[str] | None = None
                 ) -> DaemonProcess:
    """A ``kvd serve`` on loopback with a unique name (so its shm prefix is ours alone)."""
    return DaemonProcess.start(f"vs{role}-{uuid.uuid4().hex[:8]}", log_dir,
                               extra_args=extra_args, metrics=False)


def _unlink_segments(d: DaemonProcess) -> list[str]:
    leftovers = kvd_segments(f"kvd-{d.name}")
    for name in leftovers:  # never leave junk in /dev/shm, even when failing
        (SHM_DIR / name).unlink(missing_ok=True)
    return leftovers


def stop_daemon(d: DaemonProcess) -> None:
    """SIGTERM; the daemon must exit 0 and leave no shm segment behind."""
    rc = d.stop()
    leftovers = _unlink_segments(d)
    assert rc == 0, f"{d.name} exited with {rc}:\n{d.log_path.read_text()[-3000:]}"
    assert not leftovers, f"{d.name} left shm segments {leftovers}"


@contextmanager
def daemon_pair(log_dir: Path, roles: tuple[str, str], extra_args: list[str] | None = None
                ) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """A prefill and a decode daemon: the first killed if the second cannot start, both
    stopped (and checked clean) at the end, the second even when the first fails."""
    p = start_daemon(log_dir, roles[0], extra_args)
    try:
        d = start_daemon(log_dir, roles[1], extra_args)
    except BaseException:
        kill_daemon(p)
        raise
    try:
        yield p, d
    finally:
        try:
            stop_daemon(p)
        finally:
            stop_daemon(d)


def kill_daemon(d: DaemonProcess) -> None:
    """SIGKILL (a crash): the daemon cannot clean up, so its segments are removed here."""
    if d.proc.poll() is None:
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
    _unlink_segments(d)


# ------------------------------------------------------------------ KV pattern


def kv_pattern(tag: int, layer: int, positions: torch.Tensor, heads: torch.Tensor,
               channels: int) -> torch.Tensor:
    """int32 [positions, heads, channels]: one well-mixed value per element and tag."""
    pos = positions.to(torch.int64).view(-1, 1, 1)
    head = heads.to(torch.int64).view(1, -1, 1)
    ch = torch.arange(channels, dtype=torch.int64).view(1, 1, -1)
    x = (tag * 0x9E3779B1 + layer * 0x85EBCA77 + pos * 0xC2B2AE3D + head * 0x27D4EB2F
         + ch * 0x165667B1) & 0xFFFFFFFF
    x = (x ^ (x >> 15)) * 0x2C1B3C6D & 0xFFFFFFFF
    x = x ^ (x >> 13)
    return (x & 0x7FFFFFFF).to(torch.int32)


def _slots(block_ids: list[int], block_size: int, start: int, end: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token positions [start, end) and the (block id, offset) slot of each."""
    pos = torch.arange(start, end, dtype=torch.int64)
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return pos, ids[pos // block_size], pos % block_size


# ------------------------------------------------------------------ one engine


def _ranks_patch(tp_rank: int) -> Callable[[Any], tuple[int, int, int, int]]:
    """vllm_geometry._ranks for a worker built outside vLLM's distributed state."""

    def ranks(parallel_config: Any) -> tuple[int, int, int, int]:
        return (tp_rank, parallel_config.tensor_parallel_size, 0,
                parallel_config.pipeline_parallel_size)

    return ranks


_hash_ready = False


@dataclass
class Received:
    """A decode request's blocks and every rank's cache, as they were when kvd finished."""

    block_ids: list[int]
    # never in a repr: pytest would print whole pools (and a pool freed by then crashes)
    caches: list[dict[str, torch.Tensor]] = field(repr=False)
    failed: bool


@dataclass
class SimEngine:
    """One vLLM engine: the real scheduler, one worker connector and KV cache per TP rank."""

    engine_id: str
    tag: int
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    scheduler: Scheduler
    workers: list[KvdConnector]
    # never in a repr: pytest would print whole pools (and a pool freed by then crashes)
    caches: list[dict[str, torch.Tensor]] = field(repr=False)
    aggregator: KVOutputAggregator
    initial_free: int
    # Per request: the token ranges each step computed locally (the fake forward pass).
    computed: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    # Per request: its block ids when this engine last computed some of its tokens.
    blocks_seen: dict[str, list[int]] = field(default_factory=dict)
    outputs: dict[str, list[EngineCoreOutput]] = field(default_factory=dict)
    # Per request whose receive the workers reported: its blocks and a copy of every
    # rank's cache taken that very step, before vLLM schedules the request again
    # (it recomputes the last prompt token, which would overwrite that slot).
    received: dict[str, Received] = field(default_factory=dict)
    stats: list[dict[str, Any]] = field(default_factory=list)  # connector stats, per step
    step_s: list[float] = field(default_factory=list)  # wall time of each step

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size

    @property
    def tp_size(self) -> int:
        return len(self.workers)

    @property
    def heads_per_rank(self) -> int:
        return NUM_KV_HEADS // self.tp_size

    @property
    def connector(self) -> KvdConnector:
        conn = self.scheduler.connector
        assert isinstance(conn, KvdConnector)
        return conn

    # -------------------------------------------------------------- requests

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 1,
            kv_transfer_params: dict[str, Any] | None = None) -> Request:
        """A request as vLLM's front end makes it: params in SamplingParams.extra_args,
        decoded from JSON (the connector may change its own copy, never the caller's)."""
        extra = ({"kv_transfer_params": json.loads(json.dumps(kv_transfer_params))}
                 if kv_transfer_params is not None else None)
        sp = SamplingParams(max_tokens=max_tokens, extra_args=extra)
        sp.update_from_generation_config({}, MODEL_CONFIG["eos_token_id"])
        req = Request(request_id=request_id, prompt_token_ids=list(prompt),
                      sampling_params=sp, pooling_params=None,
                      block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.scheduler.add_request(req)
        return req

    def abort(self, request_id: str) -> None:
        """What the API server does when a client disconnects."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def finished(self, request_id: str) -> EngineCoreOutput | None:
        """The output that finished the request, if any."""
        for out in self.outputs.get(request_id, []):
            if out.finish_reason is not None:
                return out
        return None

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def status(self, request_id: str) -> str | None:
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.status.name

    # -------------------------------------------------------------- one step

    def has_work(self) -> bool:
        """vLLM's EngineCore steps only while the scheduler says it has requests."""
        return self.scheduler.has_requests()

    def step(self) -> SchedulerOutput | None:
        """One engine-core step, as vLLM runs it; None when the engine core would idle."""
        if not self.has_work():
            return None
        start = time.monotonic()
        try:
            return self._step()
        finally:
            self.step_s.append(time.monotonic() - start)

    def _step(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        if so.new_block_ids_to_zero:
            self._zero(so.new_block_ids_to_zero)
        meta = so.kv_connector_metadata
        assert meta is not None
        for w in self.workers:
            w.bind_connector_metadata(meta)
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for w in self.workers:  # vLLM's model runner, around the forward pass
            w.start_load_kv(None)
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            n = so.num_scheduled_tokens[rid]
            end = req.num_computed_tokens  # schedule() already advanced it by n
            self._forward(rid, end - n, end)
            sampled.append([SAMPLED_TOKEN] if end >= req.num_tokens else [])
        for w in self.workers:
            w.wait_for_save()
        outputs = []
        for w in self.workers:
            res = w.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(
                finished_sending=set(res.finished_sending) or None,
                finished_recving=set(res.finished_recving) or None,
                failed_recving=set(res.failed_recving),
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(
                req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[list(s) for s in sampled], kv_connector_output=kvo))
            if kvo.kv_connector_stats is not None:
                self.stats.append(dict(kvo.kv_connector_stats.data))
        mro = self.aggregator.aggregate(outputs, output_rank=0)
        assert mro is not None and mro.kv_connector_output is not None
        for rid in mro.kv_connector_output.finished_recving or ():
            if rid in self.scheduler.requests:
                self.received[rid] = Received(
                    self.block_ids(rid),
                    [{n: t.clone() for n, t in c.items()} for c in self.caches],
                    failed=rid in mro.kv_connector_output.failed_recving
                    or bool(mro.kv_connector_output.invalid_block_ids))
        for eco in self.scheduler.update_from_output(so, mro).values():
            for out in eco.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
        return so

    def _forward(self, request_id: str, start: int, end: int) -> None:
        """The fake forward pass: write this engine's pattern into tokens [start, end)
        of every rank (each its own heads), through vLLM's per-layer views."""
        self.computed.setdefault(request_id, []).append((start, end))
        block_ids = self.blocks_seen[request_id] = self.block_ids(request_id)
        pos, blk, off = _slots(block_ids, self.block_size, start, end)
        for rank, cache in enumerate(self.caches):
            heads = self._heads(rank)
            for layer, name in enumerate(LAYER_NAMES):
                view = cache[name].view(torch.int32)  # [block, head, token, K||V]
                # Advanced indices on dims 0 and 2 around a slice: result is [n, H, C].
                view[blk, :, off, :] = kv_pattern(self.tag, layer, pos, heads, view.shape[-1])

    def _zero(self, block_ids: list[int]) -> None:
        for cache in self.caches:
            for name in LAYER_NAMES:
                cache[name][block_ids] = 0

    def _heads(self, rank: int) -> torch.Tensor:
        h = self.heads_per_rank
        return torch.arange(rank * h, (rank + 1) * h)

    # -------------------------------------------------------------- checks

    def read(self, rank: int, block_ids: list[int], start: int, end: int, layer: int,
             caches: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
        """int32 [n, heads_on_rank, K||V] of tokens [start, end) held in ``block_ids``."""
        _, blk, off = _slots(block_ids, self.block_size, start, end)
        cache = (caches or self.caches)[rank][LAYER_NAMES[layer]]
        return cache.view(torch.int32)[blk, :, off, :].clone()

    def kv_mismatches(self, block_ids: list[int], start: int, end: int, tag: int,
                      caches: list[dict[str, torch.Tensor]] | None = None) -> int:
        """Elements of tokens [start, end), every rank and layer, that differ from ``tag``'s
        (in ``caches``, a snapshot, or else the live cache)."""
        bad = 0
        for rank in range(self.tp_size):
            for layer in range(NUM_LAYERS):
                got = self.read(rank, block_ids, start, end, layer, caches)
                want = kv_pattern(tag, layer, torch.arange(start, end), self._heads(rank),
                                  got.shape[-1])
                bad += int((got != want).sum())
        return bad

    def nonzero_outside(self, block_ids: Iterable[int],
                        caches: list[dict[str, torch.Tensor]] | None = None) -> int:
        """Nonzero elements in blocks other than ``block_ids`` (a fresh pool is all zeros)."""
        keep = set(block_ids)
        others = [b for b in range(self.kv_cache_config.num_blocks) if b not in keep]
        return sum(int(cache[name][others].count_nonzero())
                   for cache in (caches or self.caches) for name in LAYER_NAMES)

    def stat(self, key: str) -> float:
        """Sum of one connector stat (kvd_* totals the rank-0 worker reported) so far."""
        return sum(s.get(key, 0) for s in self.stats)

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_empty(self) -> None:
        """No request, no held block, nothing pending in the connector (vLLM's own checks)."""
        s = self.scheduler
        assert not s.requests, f"{self.engine_id}: requests left {list(s.requests)}"
        assert len(s.waiting) == 0 and len(s.kv_holding_waiting) == 0 and not s.running
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        assert not s._inflight_prefills
        for mgr in s.kv_cache_manager.coordinator.single_type_managers:  # every group
            assert not mgr.req_to_blocks, (
                f"{self.engine_id}: blocks of {list(mgr.req_to_blocks)}")
        assert self.num_free_blocks() == self.initial_free, (
            f"{self.engine_id}: {self.num_free_blocks()} free blocks, {self.initial_free} "
            "at start")
        # vLLM does not keep the null block's count (sliding windows drive it negative)
        null = s.kv_cache_manager.block_pool.null_block
        assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks if b is not null)
        sched = self.connector._scheduler
        assert sched is not None and not sched._pending, f"pulls never sent: {sched._pending}"
        # Notify-only pulls (``book._quiet``) may stay listed: their events are dropped
        # whenever the worker next polls, and an idle engine does not poll.
        book = self.workers[0]._worker.book  # type: ignore[union-attr]
        assert not (book._recving or book._sending or book._early), (
            f"{self.engine_id}: the worker still waits on kvd: recv={list(book._recving)} "
            f"send={list(book._sending)} early={list(book._early)}")

    def close(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers:
            w.shutdown()


_tags = itertools.count(101)


# ------------------------------------------------------------------ driving


def run_until(engines: Iterable[SimEngine], cond: Callable[[], object], timeout_s: float = 20.0,
              what: str = "condition", idle_sleep_s: float = 0.002) -> object:
    """Step every engine, like their engine-core loops, until ``cond()`` holds."""
    engines = list(engines)
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            state = {e.engine_id: {r: q.status.name for r, q in e.scheduler.requests.items()}
                     for e in engines}
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; "
                                 f"requests: {state}")
        for e in engines:
            e.step()
        time.sleep(idle_sleep_s)


def drain(engines: Iterable[SimEngine], timeout_s: float = 20.0) -> None:
    """Step until no engine has anything left (its loop would go idle), then check it empty."""
    engines = list(engines)
    run_until(engines, lambda: not any(e.has_work() for e in engines), timeout_s,
              what="every engine to go idle")
    for e in engines:
        e.assert_empty()


def prefill(p: SimEngine, request_id: str, prompt: list[int],
            params: dict[str, Any] | None = None, timeout_s: float = 20.0
            ) -> dict[str, Any]:
    """Run a prefill request (max_tokens=1) to its end; its kv_transfer_params, as a router
    would pass them on (through JSON)."""
    p.add(request_id, prompt, max_tokens=1,
          kv_transfer_params={"do_remote_decode": True, **(params or {})})
    out = run_until([p], lambda: p.finished(request_id), timeout_s,
                    what=f"prefill {request_id} to finish")
    assert isinstance(out, EngineCoreOutput)
    assert out.finish_reason is not None and out.finish_reason.name == "LENGTH", out
    assert out.kv_transfer_params, f"prefill {request_id} returned no kv_transfer_params"
    return json.loads(json.dumps(out.kv_transfer_params))


def prompt_tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, 512, (n,), generator=g)]
