"""The child side of engine_proc.EngineProc: one vLLM ``LLM`` and a command loop.

Run as ``python engine_child.py --reply-fd N`` by EngineProc.start (never imported by
the tests): JSON-line commands on stdin, one JSON reply per line on fd N, everything
vLLM prints to the log file. Runs under vLLM's venv. Its per-request "prompt tokens
computed" comes from ``vllm_sched_probe.RecordingScheduler``'s records (see
engine_proc's docstring).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any


def _output_ready(engine: Any, timeout_s: float) -> bool:
    """Whether ``engine.step()`` can return within ``timeout_s``: waits up to then for the
    engine core's next output. With vLLM's multiprocess engine core (``SyncMPClient``),
    ``LLMEngine.step()`` blocks in ``get_output()`` until the core sends an output, and a
    core whose only requests wait for remote KV sends none for as long as they wait: a
    decode's progressive pull then held ``poll`` (and a test thread that was to start the
    prefill next) for the whole hold timeout. An in-process core (no output queue) never
    blocks there."""
    if getattr(engine, "should_execute_dummy_batch", False):
        return True
    queue = getattr(engine.engine_core, "outputs_queue", None)
    if queue is None:
        return True
    with queue.not_empty:
        return bool(queue.not_empty.wait_for(lambda: len(queue.queue) > 0,
                                             timeout=max(timeout_s, 0.0)))


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
        # submit/poll (requests in flight across commands): id -> its token times
        self.inflight: dict[str, list[float]] = {}
        self.internal_ids: dict[str, str] = {}  # caller's request id -> vLLM's

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

    def op_submit(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Add requests (``[{request_id, prompt, max_tokens, kv_transfer_params}]``)
        without stepping: ``poll`` steps the engine and returns them once finished."""
        for req in msg["requests"]:
            rid = req["request_id"]
            if rid in self.inflight:
                raise ValueError(f"request id {rid} is already in flight")
            self._add(rid, req["prompt"], req["max_tokens"], req.get("kv_transfer_params"))
            self.inflight[rid] = []
        return {"in_flight": len(self.inflight)}

    def op_poll(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Step the engine for up to ``timeout_s``, until a submitted request finishes; the
        finished ones' results (none when the engine core sent nothing meanwhile: its
        requests wait for remote KV)."""
        engine = self.llm.llm_engine
        deadline = time.monotonic() + float(msg.get("timeout_s", 0.5))
        finished: dict[str, Any] = {}
        while self.inflight and not finished:
            if not _output_ready(engine, deadline - time.monotonic()):
                break
            outs = engine.step()
            t1 = time.monotonic()
            for out in outs:
                times = self.inflight.get(out.request_id)
                if times is None:
                    continue
                times.extend([t1] * (len(out.outputs[0].token_ids) - len(times)))
                if out.finished:
                    finished[out.request_id] = out
            if time.monotonic() >= deadline:
                break
        if not finished:
            return {"results": [], "in_flight": len(self.inflight)}
        self._read_sched()
        results = []
        for rid, out in finished.items():
            r = self._result(rid, out)
            r["token_times"] = self.inflight.pop(rid)
            results.append(r)
        return {"results": results, "in_flight": len(self.inflight)}

    def op_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Abort submitted requests, as a client that went away: vLLM ends them ABORTED
        (its connector's ``request_finished`` sees that); they return no result."""
        ids = [rid for rid in msg["request_ids"] if rid in self.inflight]
        self.llm.llm_engine.abort_request(ids)
        for rid in ids:
            del self.inflight[rid]
            self.internal_ids.pop(rid, None)
        return {"aborted": ids}

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
            self._add(rid, ids, max_tokens, kv_params[i] if kv_params else None)

        finished: dict[str, Any] = {}
        # When each request's tokens came out (CLOCK_MONOTONIC: the test process reads
        # the same clock), for the daemon-fault tests.
        token_times: dict[str, list[float]] = {rid: [] for rid in request_ids}
        while len(finished) < len(request_ids):
            outs = engine.step()
            t1 = time.monotonic()
            for out in outs:
                if out.request_id in order:
                    times = token_times[out.request_id]
                    times.extend([t1] * (len(out.outputs[0].token_ids) - len(times)))
                if out.finished and out.request_id in order:
                    finished[out.request_id] = out
        self._read_sched()
        results = [self._result(rid, finished[rid]) for rid in request_ids]
        for r in results:
            r["token_times"] = token_times[r["request_id"]]
        return results

    def _add(self, rid: str, ids: list[int], max_tokens: int,
             params: dict[str, Any] | None) -> None:
        from vllm import SamplingParams

        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            logprobs=1,
            ignore_eos=True,
            detokenize=False,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        internal = self.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(ids)}, sp)
        if isinstance(internal, str):  # vLLM's own id of it, the scheduler records' key
            self.internal_ids[rid] = internal

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
        internal = self.internal_ids.pop(rid, None)
        if internal is not None:  # exact: a reused caller id has older records too
            return self.sched.pop(internal, None)
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
    sys.exit(_child_main(sys.argv))
