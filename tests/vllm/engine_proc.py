"""A long-lived vLLM engine in a child process, driven over a pipe.

Why a child process: a disaggregated test needs a prefill engine and a decode
engine alive at the same time, each with its own KV connector instance, and a
vLLM ``LLM`` owns process-global state (its EngineCore and worker processes,
the torch thread settings, signal handlers). One ``EngineProc`` = one
``python engine_proc.py --child`` process that builds one ``LLM`` and then
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

Only the standard library is imported at module level, so the parent side
works in any venv; the child needs vLLM.
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
import traceback
import weakref
from pathlib import Path
from typing import Any

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
}

PROBE_SCHEDULER = "vllm_sched_probe.RecordingScheduler"


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

        child_env = dict(os.environ)
        child_env.update(BASE_ENV)
        pythonpath = [str(HERE)] + [p for p in child_env.get("PYTHONPATH", "").split(":") if p]
        child_env["PYTHONPATH"] = ":".join(pythonpath)
        if sched_log is not None:
            child_env["KVD_TEST_SCHED_LOG"] = str(sched_log)
        child_env.update(env or {})

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
                    str(Path(__file__).resolve()),
                    "--child",
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


class _Child:
    """The child side: one ``LLM`` and a command loop. Runs under vLLM's venv."""

    def __init__(self, reply_fd: int) -> None:
        os.set_inheritable(reply_fd, False)
        self.reply = os.fdopen(reply_fd, "w", buffering=1)
        self.llm: Any = None
        self.counter = 0
        self.sched_log = os.environ.get("KVD_TEST_SCHED_LOG")
        self.sched_offset = 0
        # internal request id -> accumulated scheduler records
        self.sched: dict[str, dict[str, Any]] = {}

    def send(self, obj: dict[str, Any]) -> None:
        self.reply.write(json.dumps(obj) + "\n")
        self.reply.flush()

    def serve(self) -> int:
        for line in sys.stdin:
            if not line.strip():
                continue
            msg = json.loads(line)
            op = msg.get("op")
            try:
                handler = getattr(self, f"op_{op}")
                result = handler(msg)
                self.send({"ok": True, **result})
            except Exception:
                self.send({"ok": False, "error": traceback.format_exc()})
                if op == "start":
                    return 1
            if op == "close":
                # The engine is down; the interpreter's own exit (atexit hooks,
                # multiprocessing bookkeeping) took another ~6 s for nothing.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
        # Parent went away: shut down anyway so no EngineCore is left behind.
        self.op_close({})
        return 0

    def op_start(self, msg: dict[str, Any]) -> dict[str, Any]:
        from vllm import LLM

        kwargs = dict(msg["llm_kwargs"])
        self.llm = LLM(**kwargs)
        cfg = self.llm.llm_engine.vllm_config
        info = {
            "block_size": cfg.cache_config.block_size,
            "num_gpu_blocks": cfg.cache_config.num_gpu_blocks,
            "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "scheduler_cls": str(cfg.scheduler_config.scheduler_cls),
            "vllm_pid": os.getpid(),
        }
        warmup_s = 0.0
        if msg.get("warmup", True):
            t0 = time.monotonic()
            self._generate([[3, 4, 5, 6, 7, 8, 9, 10]], 2, None, ["warmup"])
            warmup_s = time.monotonic() - t0
        return {"info": info, "warmup_s": warmup_s}

    def op_generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        results = self._generate(
            msg["prompts"],
            msg["max_tokens"],
            msg.get("kv_transfer_params"),
            msg.get("request_ids"),
        )
        return {"results": results, "elapsed_s": time.monotonic() - t0}

    def op_reset_prefix_cache(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"reset": bool(self.llm.reset_prefix_cache())}

    def op_close(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.llm is not None:
            engine_core = self.llm.llm_engine.engine_core
            self.llm = None
            engine_core.shutdown(timeout=msg.get("timeout"))
        return {}

    def _generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_params: list[dict[str, Any] | None] | None,
        request_ids: list[str] | None,
    ) -> list[dict[str, Any]]:
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        if request_ids is None:
            request_ids = []
            for _ in prompts:
                request_ids.append(f"r{self.counter}")
                self.counter += 1
        order = {rid: i for i, rid in enumerate(request_ids)}
        if len(order) != len(request_ids):
            raise ValueError(f"duplicate request ids: {request_ids}")
        for i, (rid, ids) in enumerate(zip(request_ids, prompts, strict=True)):
            params = kv_params[i] if kv_params else None
            sp = SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                logprobs=1,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": params} if params is not None else None,
            )
            engine.add_request(rid, {"prompt_token_ids": list(ids)}, sp)

        finished: dict[str, Any] = {}
        while len(finished) < len(request_ids):
            for out in engine.step():
                if out.finished and out.request_id in order:
                    finished[out.request_id] = out
        self._read_sched()
        return [self._result(rid, finished[rid]) for rid in request_ids]

    def _read_sched(self) -> None:
        """Fold the scheduler records written since the last call into ``self.sched``."""
        if not self.sched_log:
            return
        with open(self.sched_log) as f:
            f.seek(self.sched_offset)
            data = f.read()
        # Only whole lines; a partial last line is read next time.
        end = data.rfind("\n") + 1
        self.sched_offset += len(data[:end].encode())
        for line in data[:end].splitlines():
            rec = json.loads(line)
            acc = self.sched.setdefault(
                rec["req"],
                {
                    "prompt_tokens_computed": 0,
                    "first_start": None,
                    "steps": [],
                    "local_cached": None,
                    "external_cached": None,
                },
            )
            acc["prompt_tokens_computed"] += rec["prompt_part"]
            if rec["prompt_part"] and acc["first_start"] is None:
                acc["first_start"] = rec["start"]
            acc["steps"].append([rec["start"], rec["n"]])
            if "local_cached" in rec:
                acc["local_cached"] = rec["local_cached"]
                acc["external_cached"] = rec["external_cached"]

    def _sched_for(self, rid: str) -> dict[str, Any] | None:
        # vLLM's internal id is "<caller id>-<8 random characters>".
        matches = [k for k in self.sched if k.rsplit("-", 1)[0] == rid and len(k) == len(rid) + 9]
        if len(matches) != 1:
            return None
        return self.sched.pop(matches[0])

    def _result(self, rid: str, out: Any) -> dict[str, Any]:
        comp = out.outputs[0]
        token_ids = [int(t) for t in comp.token_ids]
        logprobs: list[float | None] = []
        for tok, lp in zip(token_ids, comp.logprobs or [None] * len(token_ids), strict=True):
            entry = lp.get(tok) if lp else None
            logprobs.append(float(entry.logprob) if entry is not None else None)
        sched = self._sched_for(rid) if self.sched_log else None
        kvp = out.kv_transfer_params
        return {
            "request_id": rid,
            "token_ids": token_ids,
            "logprobs": logprobs,
            "finish_reason": comp.finish_reason,
            "kv_transfer_params": json.loads(json.dumps(kvp)) if kvp is not None else None,
            "num_cached_tokens": out.num_cached_tokens,
            "prompt_len": len(out.prompt_token_ids or []),
            "prompt_tokens_computed": sched["prompt_tokens_computed"] if sched else None,
            "first_start": sched["first_start"] if sched else None,
            "local_cached": sched["local_cached"] if sched else None,
            "external_cached": sched["external_cached"] if sched else None,
            "sched_steps": sched["steps"] if sched else None,
        }


def _child_main(argv: list[str]) -> int:
    reply_fd = int(argv[argv.index("--reply-fd") + 1])
    return _Child(reply_fd).serve()


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.exit(_child_main(sys.argv))
    print(__doc__)
