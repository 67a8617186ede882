"""The exposed tail of a progressive pull against the sequential hand-off, in whole
vLLM engines: TTFT through ``kvd router`` minus a standalone engine's TTFT on the same
prompt (``ttft_minus_plain_p50_ms`` of ``kvd bench vllm``), per prompt length, on one
daemon (kvd-1d) and two daemons over NIXL (kvd-2d-nixl), sequential and progressive,
side by side in one run per prompt length (``kvd bench vllm --systems progressive``).

Run it from the venv that has vLLM, holding the vLLM lock on a shared host:

    flock /tmp/kvd-vllm.lock .venv-vllm/bin/python benchmarks/progressive_tail.py \\
        --prompt-tokens 1024,4096,8192 --out /tmp/progressive.json

The table: per prompt length and daemon layout, the sequential and the progressive
tail (ms, median of the warm rounds) and their ratio (target: <= 0.25 at 4K and 8K,
never above 1 at 1K), and whether every token equalled the standalone engine's.

Beside the issue's tail, the paired one (``tail_after_prefill_p50_ms``): each routed
request's first token minus the time its own prefill engine finished the prompt (from
the traces, so every run is ``--breakdown``). On this CPU host the standalone engine's
TTFT moves by hundreds of ms between rounds (0.6-1.9 s at 4K), more than the tails
(30-300 ms), so the issue's tail of a few rounds is that noise; the paired tail cancels
it, request by request. ``prefill/plain`` (the prefill's compute over the standalone
TTFT of the same round, median) shows whether progressive sealing slowed the prefill,
which the paired tail alone would hide (an unslowed prefill: slightly under 1, the
standalone TTFT includes its first token's way to the client). The rules:
``kvd/tools/bench/vllm_traces.py``'s docstring.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PAIRS = (("one daemon", "kvd-1d", "kvd-1d-prog"),
         ("two daemons, NIXL", "kvd-2d-nixl", "kvd-2d-nixl-prog"))


def bench_command(tokens: int, args: argparse.Namespace, log_dir: Path,
                  out: Path) -> list[str]:
    """The `kvd bench vllm` command of one prompt length."""
    cmd = [sys.executable, "-m", "kvd", "bench", "vllm", "--systems", "progressive",
           "--prompt-tokens", str(tokens), "--rounds", str(args.rounds),
           "--batch", "1", "--batch-rounds", "1", "--idle-s", "1",
           "--max-tokens", str(args.max_tokens),
           "--max-num-batched-tokens", str(args.chunk), "--model-shape", args.model_shape,
           "--breakdown", "--out", str(out)]
    if args.breakdown:  # every process's trace points kept, in the run's work directory
        cmd += ["--work-dir", str(log_dir / f"work-{tokens}")]
    return cmd


def run_one(tokens: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One `kvd bench vllm` run; its JSON, or {"error": ...} with its log's tail (the
    other prompt lengths still run)."""
    out = log_dir / f"bench-{tokens}.json"
    log = log_dir / f"bench-{tokens}.log"
    cmd = bench_command(tokens, args, log_dir, out)
    print("+", " ".join(cmd), f"> {log}", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not out.exists():
        return {"error": f"exit {rc}: {log.read_text(errors='replace')[-2000:]}"}
    return json.loads(out.read_text())


COLUMNS = ("prompt", "daemons", "sequential tail ms", "progressive tail ms", "ratio",
           "sequential paired ms", "progressive paired ms", "paired ratio",
           "prefill/plain seq", "prefill/plain prog", "tokens equal")


def ratio(sequential: float | None, progressive: float | None) -> float | None:
    """progressive / sequential; None without both or with a sequential tail <= 0 (a
    negative tail is noise, not a base)."""
    if sequential is None or progressive is None or sequential <= 0:
        return None
    return round(progressive / sequential, 2)


def rows(tokens: int, result: dict[str, Any]) -> list[list[Any]]:
    """One row per daemon layout of one prompt length's run (COLUMNS)."""
    if "error" in result:
        return [[tokens, "(failed: see its log)", *[None] * (len(COLUMNS) - 2)]]
    by = {s["system"]: s for s in result["summaries"]}
    out = []
    for label, seq, prog in PAIRS:
        a, b = by.get(seq, {}), by.get(prog, {})
        tail = "ttft_minus_plain_p50_ms"
        paired = "tail_after_prefill_p50_ms"
        out.append([tokens, label, a.get(tail), b.get(tail), ratio(a.get(tail), b.get(tail)),
                    a.get(paired), b.get(paired), ratio(a.get(paired), b.get(paired)),
                    a.get("prefill_vs_plain_p50"), b.get("prefill_vs_plain_p50"),
                    f"{a.get('tokens_equal')} / {b.get('tokens_equal')}"])
    return out


def table(results: dict[int, dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for tokens, res in results.items():
        for row in rows(tokens, res):
            lines.append("| " + " | ".join("-" if v is None else str(v) for v in row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", default="1024,4096,8192")
    ap.add_argument("--rounds", type=int, default=6, help="the first is the warm-up")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens")
    ap.add_argument("--model-shape", default="tiny", help="kvd bench vllm --model-shape: "
                    "tiny, or kv-heavy (16 times the KV a token)")
    ap.add_argument("--out", default="")
    ap.add_argument("--log-dir", default="", help="each run's JSON and log (default: a "
                    "temporary directory, kept)")
    ap.add_argument("--breakdown", action="store_true", help="keep each run's work "
                    "directory (traces, logs) under --log-dir (every run traces: the "
                    "paired tail needs them)")
    args = ap.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvd-progressive-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict[str, Any]] = {}
    for t in args.prompt_tokens.split(","):
        results[int(t)] = run_one(int(t), args, log_dir)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        print(table({int(t): results[int(t)]}), file=sys.stderr, flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
