"""A long-lived vLLM engine in a child process, driven over a pipe.

Why a child process: a disaggregated test needs a prefill engine and a decode
engine alive at the same time, each with its own KV connector instance, and a
vLLM ``LLM`` owns process-global state (its EngineCore and worker processes,
the torch thread settings, signal handlers). One ``EngineProc`` = one
``python engine_child.py`` process that builds one ``LLM`` and then
serves JSON-line commands until it is told to close.

Wire: the parent writes one JSON object per line to the child's stdin; the
child answers one JSON object per line on a dedicated pipe (``--reply-fd``).
The child's stdout/stderr, and those of vLLM's EngineCore and worker processes
it spawns, all go to the log file: vLLM logs to stdout, so stdout cannot carry
the protocol. The child runs in its own session, so ``close()`` can end the
whole tree (child, EngineCore, worker) by process group when a clean shutdown
does not finish in time.

"Prompt tokens computed": ``RequestOutput.num_cached_tokens`` does not say what
a decode engine loaded (vLLM copies the prefill side's count into it), so each
engine runs ``vllm_sched_probe.RecordingScheduler`` (vLLM's own scheduler plus
a per-step record) and ``generate`` sums, per request, the prompt tokens that
were scheduled through the model. See ``vllm_sched_probe`` for the record.

This module is the parent side (standard library only, so it works in any venv);
the child side, which needs vLLM, is engine_child.py.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proc_probe import descendants

HERE = Path(__file__).resolve().parent

DEFAULT_KV_CACHE_BYTES = 64 << 20
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_GENERATE_TIMEOUT_S = 300.0

# Environment every engine gets (the caller's env argument wins): no hub, no
# usage reporting, and this directory importable so the EngineCore process can
# import the recording scheduler by name.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # On CPU the worker never exits by itself at shutdown (it ignores the
    # closed queues and SIGTERM and is SIGKILLed after a 4 s grace), so vLLM's
    # default 5 s wait for it is pure delay.
    "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1",
    # vLLM's CPU backend pins each engine's worker to the cores it picks for local rank 0
    # ("auto"): the same cores for every engine of a host, core 0 for the worker's main
    # thread and every thread it starts (kvd's event poller, ZMQ I/O). A worker waiting
    # for its next step spins in sched_yield; pinned next to another engine's, one got no
    # CPU for 30 s while the other spun (the kernel charged the spinner's group
    # nothing, so the starved group never became eligible), past the prefill leases.
    # Unpinned, the kernel moves threads to whichever core is free. $KVD_TEST_VLLM_CPU_BIND
    # (see engine_environment) puts vLLM's default back, to reproduce it.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}

PROBE_SCHEDULER = "vllm_sched_probe.RecordingScheduler"

#: In the test process's environment: ``auto`` gives the engines vLLM's default CPU
#: binding (the 30 s decode step's reproduction: ``VLLM_CPU_OMP_THREADS_BIND`` and
#: ``OMP_NUM_THREADS`` as the parent has them, unset by default); any other value is
#: used as ``VLLM_CPU_OMP_THREADS_BIND`` itself.
BIND_OVERRIDE = "KVD_TEST_VLLM_CPU_BIND"


def engine_environment(parent: Mapping[str, str], env: Mapping[str, str] | None = None,
                       sched_log: Path | None = None) -> dict[str, str]:
    """The environment of an engine child: ``parent``'s, then BASE_ENV (less what
    ``$KVD_TEST_VLLM_CPU_BIND`` in ``parent`` takes back), this directory first on
    PYTHONPATH, the scheduler record's path, and ``env`` last (it wins)."""
    child_env = dict(parent)
    child_env.update(BASE_ENV)
    bind = parent.get(BIND_OVERRIDE, "")
    if bind == "auto":
        for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
            if key in parent:
                child_env[key] = parent[key]
            else:
                child_env.pop(key)
    elif bind:
        child_env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    pythonpath = [str(HERE)] + [p for p in child_env.get("PYTHONPATH", "").split(":") if p]
    child_env["PYTHONPATH"] = ":".join(pythonpath)
    if sched_log is not None:
        child_env["KVD_TEST_SCHED_LOG"] = str(sched_log)
    child_env.update(env or {})
    return child_env


def steps_in_windows(lines: list[dict[str, float]], windows: list[tuple[float, float]]
                     ) -> tuple[int, list[float]]:
    """(schedule() calls, gaps over 50 ms) inside the windows, from the probe's lines
    (tests/integrations/vllm/vllm_sched_probe.py).

    A line at ``t`` counts ``steps`` calls: the one at ``t``, which came ``gap`` after
    the one before it, and ``steps - 1`` earlier ones, made between the previous line
    and ``t - gap``. The earlier ones count when that span lies inside a window (one
    that straddles a window's edge is not counted: never more steps than were made in
    it), the one at ``t`` when ``t`` is in one. A gap that began before the window is the idle wait
    before the engine got work, not a step; one over 50 ms that began inside is slow.
    (Counting a line only when its own gap began inside a window found no step at all
    in an engine whose every step was fast and whose windows were under half a
    second: its lines are written after an idle gap, or twice a second.)"""
    calls, slow = 0, []
    prev_t: float | None = None
    for s in lines:
        t, gap, steps = s["t"], s["gap"], int(s["steps"])
        before = t - gap
        since = before if prev_t is None else prev_t
        for t0, t1 in windows:
            if steps > 1 and t0 <= since and before <= t1:
                calls += steps - 1
                break
        for t0, t1 in windows:
            if t0 <= t <= t1:
                calls += 1
                if t0 <= before and gap > 0.05:
                    slow.append(gap)
                break
        prev_t = t
    return calls, slow


class EngineProcError(RuntimeError):
    """The engine child failed, died or timed out; the message ends with its log tail."""


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's process group (child, EngineCore, workers): ours alone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class EngineProc:
    """Parent-side handle of one engine child process; see the module docstring."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        reply_fd: int,
        log_path: Path,
        sched_log_path: Path | None,
        name: str,
    ) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path
        self.sched_log_path = sched_log_path
        self._reply_fd = reply_fd
        self._buf = b""
        self._closed = False
        #: Seconds from spawning the child to the LLM being built (imports included).
        self.startup_s: float = 0.0
        #: Seconds the warm-up request took inside ``startup_s`` (the first CPU
        #: forward pass is much slower than later ones).
        self.warmup_s: float = 0.0
        #: Seconds the last ``generate`` took, measured in the child.
        self.last_generate_s: float = 0.0
        #: Facts about the built engine that the child reported (block size, KV layout...).
        self.info: dict[str, Any] = {}
        self._finalizer = weakref.finalize(self, _kill_group, proc.pid)

    # ------------------------------------------------------------------ start

    @classmethod
    def start(
        cls,
        model_dir: str | os.PathLike[str],
        *,
        kv_transfer_config: dict[str, Any] | None = None,
        block_size: int = 32,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int = 4096,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        record_scheduling: bool = True,
        warmup: bool = True,
        llm_kwargs: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        name: str = "engine",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    ) -> EngineProc:
        """Spawn the child, build ``LLM(...)`` there and wait until it is ready.

        ``kv_transfer_config`` is passed to ``LLM`` as a dict (it must be JSON).
        ``llm_kwargs`` adds or overrides ``LLM`` arguments (JSON values only).
        ``block_size`` must be a multiple of 32 on CPU. ``warmup`` runs one short
        plain request (8 tokens, no kv_transfer_params, never a full block, so it
        leaves nothing in the prefix cache that a test prompt could hit) to take
        the slow first forward pass out of the tests' timings.
        ``record_scheduling=False`` runs vLLM's stock scheduler; then
        ``prompt_tokens_computed`` is ``None``.
        """
        model_dir = Path(model_dir).resolve()
        if log_path is None:
            fd, tmp = tempfile.mkstemp(prefix=f"kvd-{name}-", suffix=".log")
            os.close(fd)
            log_path = tmp
        log = Path(log_path).resolve()
        log.parent.mkdir(parents=True, exist_ok=True)
        sched_log = log.with_name(log.name + ".sched.jsonl") if record_scheduling else None
        if sched_log is not None:
            sched_log.write_text("")

        child_env = engine_environment(os.environ, env, sched_log)

        kwargs: dict[str, Any] = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "load_format": "safetensors",
            "dtype": "float32",
            "enforce_eager": True,
            "block_size": block_size,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "max_model_len": max_model_len,
            "enable_prefix_caching": enable_prefix_caching,
            "seed": seed,
        }
        if record_scheduling:
            kwargs["scheduler_cls"] = PROBE_SCHEDULER
        if kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config
        kwargs.update(llm_kwargs or {})

        reply_r, reply_w = os.pipe()
        t0 = time.monotonic()
        with open(log, "ab") as log_file:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    str(HERE / "engine_child.py"),
                    "--reply-fd",
                    str(reply_w),
                ],
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                pass_fds=(reply_w,),
                env=child_env,
                start_new_session=True,
            )
        os.close(reply_w)
        self = cls(proc, reply_r, log, sched_log, name)
        try:
            ready = self._call(
                {"op": "start", "llm_kwargs": kwargs, "warmup": warmup}, startup_timeout_s
            )
        except BaseException:
            self._force_kill()
            raise
        self.startup_s = time.monotonic() - t0
        self.warmup_s = float(ready.get("warmup_s", 0.0))
        self.info = dict(ready.get("info", {}))
        return self

    # --------------------------------------------------------------- generate

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int = 16,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        *,
        request_ids: list[str] | None = None,
        timeout_s: float = DEFAULT_GENERATE_TIMEOUT_S,
    ) -> list[dict[str, Any]]:
        """Greedy-generate ``max_tokens`` tokens for each prompt (token ids), as one batch.

        Sampling: temperature 0, ``logprobs=1``, ``ignore_eos`` (always exactly
        ``max_tokens`` tokens), no detokenization. ``kv_transfer_params[i]``
        goes into prompt i's ``SamplingParams.extra_args["kv_transfer_params"]``
        (``None``: a plain request). ``request_ids`` default to unique ids from
        the child.

        Returns, per prompt in order, a dict with: ``request_id`` (the caller's
        id; vLLM's internal one adds a random suffix), ``token_ids``,
        ``logprobs`` (of the chosen tokens), ``finish_reason``,
        ``kv_transfer_params`` (the output's, JSON round-tripped),
        ``num_cached_tokens`` (vLLM's; on a decode engine this is the prefill
        side's count, not what was loaded), ``prompt_len``, and from the
        scheduler record (``None`` when ``record_scheduling=False``):
        ``prompt_tokens_computed`` (prompt tokens that went through the model,
        all steps, recomputation included), ``first_start`` (tokens already
        present at the first computing step: prefix-cache hit plus KV loaded by
        the connector), ``local_cached`` / ``external_cached`` (vLLM's
        admission-time ``PrefillStats``), ``sched_steps`` (``[start, n]`` per
        step).
        """
        if kv_transfer_params is not None and len(kv_transfer_params) != len(prompts):
            raise ValueError("kv_transfer_params must have one entry per prompt")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise ValueError("request_ids must have one entry per prompt")
        reply = self._call(
            {
                "op": "generate",
                "prompts": [[int(t) for t in p] for p in prompts],
                "max_tokens": max_tokens,
                "kv_transfer_params": kv_transfer_params,
                "request_ids": request_ids,
            },
            timeout_s,
        )
        self.last_generate_s = float(reply["elapsed_s"])
        return list(reply["results"])

    def submit(self, requests: list[dict[str, Any]], timeout_s: float = 60.0) -> int:
        """Add requests to the engine without waiting for them: each a dict with
        ``request_id`` (unique among those in flight), ``prompt`` (token ids),
        ``max_tokens`` and ``kv_transfer_params`` (or ``None``), sampled as in
        ``generate``. ``poll`` runs the engine and returns them. Returns how many
        submitted requests are in flight."""
        reply = self._call({"op": "submit", "requests": requests}, timeout_s)
        return int(reply["in_flight"])

    def poll(self, step_s: float = 0.5, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Step the engine for up to ``step_s`` or until a submitted request finishes;
        the finished submitted requests, each as ``generate`` returns it
        (``token_times`` included), in no order. Returns after ``step_s`` with none
        while the engine core sends nothing (its requests wait for remote KV): the
        caller's thread may go on to start the prefill those requests wait for."""
        reply = self._call({"op": "poll", "timeout_s": step_s}, timeout_s)
        return list(reply["results"])

    def abort(self, request_ids: list[str], timeout_s: float = 60.0) -> list[str]:
        """Abort submitted requests still in flight (as a client that went away); they
        return no result. Returns those aborted."""
        return list(self._call({"op": "abort", "request_ids": request_ids},
                               timeout_s)["aborted"])

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        """Drop the engine's prefix cache (vLLM's ``LLM.reset_prefix_cache``).

        Returns vLLM's answer: ``False`` when blocks are still in use (then
        nothing was dropped).
        """
        return bool(self._call({"op": "reset_prefix_cache"}, timeout_s)["reset"])

    # ------------------------------------------------------------------ close

    def close(self, timeout_s: float = 60.0) -> int | None:
        """Shut the engine down cleanly; kill the process group after ``timeout_s``.

        Returns the child's exit status (negative: killed by that signal), or
        ``None`` when it was already closed. Always ends the whole process
        group afterwards, so no EngineCore or worker outlives the test.
        """
        if self._closed:
            return None
        self._closed = True
        deadline = time.monotonic() + timeout_s
        if self.proc.poll() is None:
            try:
                # vLLM's own default gives EngineCore 5 s and then SIGKILLs it,
                # while EngineCore itself waits up to 5 s for its worker: on CPU
                # the EngineCore was always killed, so scheduler-side connector
                # teardown never ran. Half our budget lets it finish.
                self._call({"op": "close", "timeout": timeout_s / 2}, timeout_s)
            except EngineProcError:
                pass
            try:
                self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._force_kill()
        self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> EngineProc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- plumbing

    def worker_pids(self) -> list[int]:
        """The engine's vLLM worker processes (``VLLM::Worker``), found under the child."""
        found = []
        for pid in descendants(self.proc.pid)[1:]:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("VLLM::Worker"):
                        found.append(pid)
            except OSError:
                continue
        return found

    def steps_in(self, windows: list[tuple[float, float]]) -> tuple[int, list[float]]:
        """`steps_in_windows` of this engine's ``.steps`` file."""
        lines = [json.loads(x) for x in
                 Path(f"{self.sched_log_path}.steps").read_text().splitlines()]
        return steps_in_windows(lines, windows)

    def log_tail(self, lines: int = 60) -> str:
        """Last lines of the engine log (child, EngineCore and worker output)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def _force_kill(self) -> None:
        self._finalizer()  # kills the process group once; later calls are no-ops
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self._reply_fd >= 0:
            os.close(self._reply_fd)
            self._reply_fd = -1

    def _fail(self, what: str) -> EngineProcError:
        return EngineProcError(
            f"{self.name} (pid {self.proc.pid}, log {self.log_path}): {what}\n"
            f"--- log tail ---\n{self.log_tail()}"
        )

    def _call(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.proc.poll() is not None:
            raise self._fail(f"child exited with {self.proc.returncode}")
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise self._fail(f"cannot send {msg['op']!r}: {exc}") from exc
        reply = self._read_reply(msg["op"], timeout_s)
        if not reply.get("ok"):
            raise self._fail(f"{msg['op']} failed in the child:\n{reply.get('error')}")
        return reply

    def _read_reply(self, op: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self._reply_fd, selectors.EVENT_READ)
        try:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._fail(f"no reply to {op!r} within {timeout_s:.0f} s")
                # Wake up now and then to notice a child that died without closing
                # the pipe (a forked grandchild may still hold its write end).
                if not sel.select(min(left, 1.0)):
                    if self.proc.poll() is not None:
                        raise self._fail(f"child exited with {self.proc.returncode} during {op!r}")
                    continue
                chunk = os.read(self._reply_fd, 1 << 20)
                if not chunk:
                    self.proc.poll()
                    raise self._fail(
                        f"reply pipe closed during {op!r} (exit status {self.proc.returncode})"
                    )
                self._buf += chunk
        finally:
            sel.close()
        line, _, self._buf = self._buf.partition(b"\n")
        return dict(json.loads(line))


# ====================================================================== child
