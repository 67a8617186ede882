"""``kvd bench vllm``'s arithmetic and its table: from the samples the runner took to
each system's summary, the targets, and the rendering. Pure: no processes, no clock.

A sample's times are seconds on the runner's monotonic clock:

* single request (``Single``): the decode's time to its first token for a request
  whose KV comes from the prefill (the hand-over; the prefill answered before the
  decode request was sent), and the TTFT of another request of the same prompt
  through ``kvd router``;
* batch (``Batch``): N prefills answered, then N decode requests sent at once: when
  each one's first token came and when its stream ended, and the gaps between its
  tokens (the decode engine's step).

The measures read from the connector's trace points are in ``vllm_traces``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

# The targets a kvd system is judged by (against the better NixlConnector setting).
TARGET_RATIO_TO_NIXL = 0.8
TARGET_IDLE_CORES_PER_ENGINE = 0.05
TARGET_SPREAD_STEPS = 1.0


@dataclass(frozen=True)
class Single:
    system: str
    round: int
    handover_s: float | None  # decode TTFT after the prefill answered (None: plain/failed)
    ttft_s: float | None  # plain: its TTFT; P/D: TTFT through the router (None: failed)
    tokens_equal: int  # of the streams compared (0, 1 or 2) with the plain reference
    compared: int
    failed: int = 0  # streams that gave no first token in time


MIN_STEP_S = 0.001  # no engine step of these engines is shorter (5-60 ms measured)


@dataclass(frozen=True)
class Batch:
    system: str
    round: int
    sent_s: float
    first_token_s: tuple[float, ...]
    end_s: tuple[float, ...]
    step_gaps_s: tuple[float, ...]  # every gap between two tokens of the batch's streams
    tokens_equal: int
    compared: int
    failed: int = 0
    tokens_s: tuple[tuple[float, ...], ...] = ()  # each stream's token times (a stall's when)

    @property
    def spread_s(self) -> float:
        return max(self.first_token_s) - min(self.first_token_s)

    @property
    def decode_s(self) -> float:
        return max(self.end_s) - self.sent_s

    @property
    def handover_s(self) -> float:
        """Until the last request of the batch had its first token."""
        return max(self.first_token_s) - self.sent_s

    @property
    def step_s(self) -> float:
        """The decode step: the median gap between two tokens of a stream, leaving out
        tokens the client read together (a gap under MIN_STEP_S: a client that did not
        get the CPU for a while reads several chunks at once; on a busy host half the
        gaps can be that, and a median of ~0 made spreads of 60,000 steps)."""
        gaps = [g for g in self.step_gaps_s if g >= MIN_STEP_S]
        return statistics.median(gaps) if gaps else 0.0


@dataclass
class Counters:
    """Per system, deltas over the run (the runner scrapes the decode's /metrics)."""

    decode_requests: int = 0
    decode_computed_tokens: float = 0.0  # vllm:prompt_tokens_by_source local_compute
    decode_loaded_tokens: float = 0.0  # ... external_kv_transfer
    bytes_moved: float | None = None  # connector's own count; None: it has none
    idle_cores_per_engine: float | None = None  # engines + share of their daemons


@dataclass
class Summary:
    system: str
    handover_p50_ms: float | None = None
    handover_p95_ms: float | None = None
    first_handover_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_minus_plain_p50_ms: float | None = None
    batch_decode_p50_s: float | None = None
    batch_handover_p50_ms: float | None = None
    batch_spread_p50_ms: float | None = None
    batch_spread_max_ms: float | None = None
    decode_step_p50_ms: float | None = None
    batch_spread_steps_max: float | None = None
    batch_coscheduled_spread_steps_max: float | None = None  # traces: co_scheduled
    tail_after_prefill_p50_ms: float | None = None  # traces: paired_tails
    prefill_vs_plain_p50: float | None = None
    tokens_equal: str = ""  # equal to the plain engine's / compared (failed ones count)
    decode_computed_tokens_per_request: float | None = None
    decode_loaded_tokens_per_request: float | None = None
    bytes_per_request: float | None = None
    idle_cores_per_engine: float | None = None
    ratio_handover_to_nixl: float | None = None
    ratio_batch_to_nixl: float | None = None
    notes: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[min(len(ordered), int(rank)) - 1]


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 1)


def summarize(system: str, singles: Sequence[Single], batches: Sequence[Batch],
              plain_ttft_by_round: dict[int, float], counters: Counters,
              warmup_rounds: int = 1) -> Summary:
    out = Summary(system)
    warm = [s for s in singles if s.round >= warmup_rounds]
    handovers = [s.handover_s for s in warm if s.handover_s is not None]
    if handovers:
        out.handover_p50_ms = _ms(statistics.median(handovers))
        out.handover_p95_ms = _ms(percentile(handovers, 95))
    first = [s for s in singles if s.round == 0 and s.handover_s is not None]
    if first:
        out.first_handover_ms = _ms(first[0].handover_s)
    ttfts = [s for s in warm if s.ttft_s is not None]
    if ttfts:
        out.ttft_p50_ms = _ms(statistics.median(s.ttft_s for s in ttfts))
        diffs = [s.ttft_s - plain_ttft_by_round[s.round] for s in ttfts
                 if s.round in plain_ttft_by_round]
        if diffs and system != "plain":
            out.ttft_minus_plain_p50_ms = _ms(statistics.median(diffs))
    if batches:
        out.batch_decode_p50_s = round(statistics.median(b.decode_s for b in batches), 3)
        out.batch_handover_p50_ms = _ms(statistics.median(b.handover_s for b in batches))
        out.batch_spread_p50_ms = _ms(statistics.median(b.spread_s for b in batches))
        out.batch_spread_max_ms = _ms(max(b.spread_s for b in batches))
        steps = [b.step_s for b in batches if b.step_s > 0]
        if steps:
            out.decode_step_p50_ms = _ms(statistics.median(steps))
            out.batch_spread_steps_max = round(max(
                b.spread_s / b.step_s for b in batches if b.step_s > 0), 2)
    equal = sum(s.tokens_equal for s in singles) + sum(b.tokens_equal for b in batches)
    compared = sum(s.compared for s in singles) + sum(b.compared for b in batches)
    out.tokens_equal = f"{equal}/{compared}"
    failed = sum(s.failed for s in singles) + sum(b.failed for b in batches)
    if failed:
        out.notes.append(f"{failed} of {compared} requests gave no first token in time")
    if counters.decode_requests:
        out.decode_computed_tokens_per_request = round(
            counters.decode_computed_tokens / counters.decode_requests, 1)
        out.decode_loaded_tokens_per_request = round(
            counters.decode_loaded_tokens / counters.decode_requests, 1)
        if counters.bytes_moved is not None:
            out.bytes_per_request = round(counters.bytes_moved / counters.decode_requests)
    out.idle_cores_per_engine = (None if counters.idle_cores_per_engine is None
                                 else round(counters.idle_cores_per_engine, 3))
    return out


def add_ratios(summaries: dict[str, Summary]) -> None:
    """Each system's hand-over and batch against the better NixlConnector setting."""
    nixl = [summaries[n] for n in ("nixl", "nixl-noprog") if n in summaries]
    best_single = min((s.handover_p50_ms for s in nixl if s.handover_p50_ms), default=None)
    best_batch = min((s.batch_decode_p50_s for s in nixl if s.batch_decode_p50_s),
                     default=None)
    for s in summaries.values():
        if s.system == "plain":
            continue
        if best_single and s.handover_p50_ms is not None:
            s.ratio_handover_to_nixl = round(s.handover_p50_ms / best_single, 2)
        if best_batch and s.batch_decode_p50_s is not None:
            s.ratio_batch_to_nixl = round(s.batch_decode_p50_s / best_batch, 2)


def targets(summaries: dict[str, Summary]) -> dict[str, Any]:
    """The issue's targets for kvd on one daemon, as measured in this run (None: the run
    lacks a system the target needs)."""
    one = summaries.get("kvd-1d")
    out: dict[str, Any] = {}
    if one is None:
        return out
    out["handover_le_0.8x_nixl"] = (None if one.ratio_handover_to_nixl is None
                                    else one.ratio_handover_to_nixl <= TARGET_RATIO_TO_NIXL)
    out["batch_le_0.8x_nixl"] = (None if one.ratio_batch_to_nixl is None
                                 else one.ratio_batch_to_nixl <= TARGET_RATIO_TO_NIXL)
    # client side: first to last first token; co-scheduled: the requests vLLM
    # scheduled in one decode step, their KV reported to vLLM (None: no traces)
    spread = {n: s for n, s in summaries.items()
              if n != "plain" and s.batch_spread_steps_max is not None}
    out["batch_within_one_step"] = {
        "client_side": {n: s.batch_spread_steps_max <= TARGET_SPREAD_STEPS
                        for n, s in spread.items()},
        "co_scheduled": {n: (None if s.batch_coscheduled_spread_steps_max is None
                             else s.batch_coscheduled_spread_steps_max
                             <= TARGET_SPREAD_STEPS) for n, s in spread.items()}}
    two = summaries.get("kvd-2d")
    out["one_daemon_not_slower_than_two"] = (
        None if two is None or two.handover_p50_ms is None or one.handover_p50_ms is None
        else (one.handover_p50_ms <= two.handover_p50_ms
              and (one.batch_decode_p50_s or 0) <= (two.batch_decode_p50_s or 0)))
    out["idle_le_0.05_core"] = (None if one.idle_cores_per_engine is None
                                else one.idle_cores_per_engine <= TARGET_IDLE_CORES_PER_ENGINE)
    return out


COLUMNS: tuple[tuple[str, str], ...] = (
    ("system", "system"),
    ("handover_p50_ms", "hand-over p50 ms"),
    ("handover_p95_ms", "p95 ms"),
    ("first_handover_ms", "first ms"),
    ("ttft_minus_plain_p50_ms", "TTFT-plain ms"),
    ("batch_decode_p50_s", "batch decode s"),
    ("batch_spread_p50_ms", "spread ms"),
    ("decode_step_p50_ms", "step ms"),
    ("batch_spread_steps_max", "spread/step max"),
    ("batch_coscheduled_spread_steps_max", "co-scheduled spread/step max"),
    ("tail_after_prefill_p50_ms", "TTFT-own prefill ms"),
    ("prefill_vs_plain_p50", "prefill/plain"),
    ("tokens_equal", "tokens equal"),
    ("decode_computed_tokens_per_request", "D computed/req"),
    ("bytes_per_request", "bytes/req"),
    ("idle_cores_per_engine", "idle cores/engine"),
    ("ratio_handover_to_nixl", "x nixl (1)"),
    ("ratio_batch_to_nixl", "x nixl (batch)"),
)


def render_table(summaries: Sequence[Summary]) -> str:
    rows = [[h for _, h in COLUMNS]]
    for s in summaries:
        d = asdict(s)
        rows.append(["-" if d[k] is None or d[k] == "" else str(d[k]) for k, _ in COLUMNS])
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def render(result: dict[str, Any]) -> str:
    summaries = [Summary(**{k: v for k, v in s.items()}) for s in result["summaries"]]
    out = [render_table(summaries), ""]
    host = result.get("host", {})
    out.append(f"host: {host.get('cpus')} cpus, load {host.get('load_before')} -> "
               f"{host.get('load_after')}; rounds {result['config']['rounds']}, batch "
               f"{result['config']['batch']} x {result['config']['batch_rounds']}, prompt "
               f"{result['config']['prompt_tokens']} tokens, {result['config']['max_tokens']} "
               "generated")
    for name, t in result.get("turn_load", {}).items():
        out.append(f"turns of {name}: {t['turns']} ({t['turn_s']} s), runnable p50 "
                   f"{t['runnable_p50']} max {t['runnable_max']}, busy cores: host "
                   f"{t['host_cores']}, the system {t['system_cores']}, hogs "
                   f"{t['hog_cores']}, others {t['others_cores']}")
    for name, why in result.get("failed_systems", {}).items():
        out.append(f"FAILED {name}: {why}")
    for name, ok in result.get("targets", {}).items():
        if isinstance(ok, dict) and ok and all(isinstance(v, dict) for v in ok.values()):
            out += [f"target {name} ({measure}): {v}" for measure, v in ok.items()]
        else:
            out.append(f"target {name}: {ok}")
    for s in summaries:
        for note in s.notes:
            out.append(f"{s.system}: {note}")
    if result.get("breakdown"):
        out += ["", "one hand-over, where the time goes (warm single requests, p50):",
                render_breakdown(result["breakdown"])]
    for name, f in result.get("first_transfers", {}).items():
        out.append(f"{name}: first transfer (pull sent -> event taken) {f['first_ms']} ms, "
                   f"warm p50 {f['warm_p50_ms']} ms ({f['x_warm']}x)")
        if f.get("phases_ms"):
            out.append("  inside the daemons, ms (first / warm p50): "
                       + ", ".join(f"{k} {a} / {b}" for k, (a, b) in f["phases_ms"].items()))
    for b in result.get("batch_landing", []):
        c = b.get("co_scheduled") or {}
        out.append(f"batch {b['system']} round {b['round']} (step {b['step_ms']} ms; "
                   f"per step {list(c.get('group_sizes', []))}, co-scheduled spread "
                   f"{c.get('spread_steps')} steps), ms after sent:")
        for k, v in b.items():
            if isinstance(v, list):
                out.append(f"  {k:18s} {v}")
    return "\n".join(out)


# ------------------------------------------------------------------ one hand-over's time

# The stages of one hand-over, in order: (name, from point, to point). Client points:
# prefill_sent, prefill_answered, decode_sent, first_token; the rest are the
# connector's (kvd.integrations.connector_core.trace). "copy" is the daemon's own
# duration of the pull, "to_daemon_and_back" the rest of pull_sent -> event_taken.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("prefill (request to its last step)", "prefill_sent", "publish_sent"),
    ("prefill answer to the client", "publish_sent", "prefill_answered"),
    ("client/router to decode request", "prefill_answered", "decode_sent"),
    ("decode server to its scheduler", "decode_sent", "decode_scheduled"),
    ("scheduled to pull sent", "decode_scheduled", "pull_sent"),
    ("pull sent to event taken (all)", "pull_sent", "event_taken"),
    ("  pull sent -> daemon took it", "pull_sent", "daemon_pull"),
    ("  daemon took it -> event queued", "daemon_pull", "daemon_event"),
    ("    its Acquire reached the producer daemon", "daemon_pull", "daemon_acquire"),
    ("    the producer daemon answered it", "daemon_acquire", "daemon_acquired"),
    ("  event queued -> sent in a poll reply", "daemon_event", "daemon_event_sent"),
    ("  poll reply sent -> worker took it", "daemon_event_sent", "event_taken"),
    ("event taken to reported to vLLM", "event_taken", "recv_reported"),
    ("reported to first token (decode's step)", "recv_reported", "first_token"),
)


PHASE = "    daemon phase "  # a row per phase of the daemon's pull: ms after it took it
DAEMON_ROWS = "    "  # the rows inside the daemon's part, shown first against warm


def breakdown(stamps: dict[str, float], copy_s: float | None,
              phases: dict[str, float] | None = None) -> dict[str, float]:
    """Stage durations (ms) of one hand-over from its time stamps (seconds, one clock);
    ``phases``: the daemon's pull's own transitions (``daemon_phase_*`` trace points:
    seconds after it took the pull), as rows under the copy."""
    out = {}
    for name, a, b in STAGES:
        if a in stamps and b in stamps:
            out[name] = round((stamps[b] - stamps[a]) * 1000, 2)
    if copy_s is not None and "pull sent to event taken (all)" in out:
        out["  of which: the daemon's pull (copy)"] = round(copy_s * 1000, 2)
        out["  of which: to the daemon and the event back"] = round(
            out["pull sent to event taken (all)"] - copy_s * 1000, 2)
    for name, at_s in (phases or {}).items():
        out[PHASE + name] = round(at_s * 1000, 2)
    if "decode_sent" in stamps and "first_token" in stamps:
        out["hand-over (decode sent to first token)"] = round(
            (stamps["first_token"] - stamps["decode_sent"]) * 1000, 2)
    return out


FIRST_STAGE = "pull sent to event taken (all)"
TARGET_FIRST_X_WARM = 2.0


def first_transfers(samples: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per kvd system: its first single hand-over's transfer (pull sent -> event taken:
    the handshake, when a pair's first pull pays it) against the warm rounds' p50."""
    out = {}
    for name, rows in samples.items():
        warm = [r[FIRST_STAGE] for r in rows[1:] if FIRST_STAGE in r]
        if not rows or FIRST_STAGE not in rows[0] or not warm:
            continue
        first, p50 = rows[0][FIRST_STAGE], statistics.median(warm)
        out[name] = {"first_ms": first, "warm_p50_ms": round(p50, 2),
                     "x_warm": round(first / p50, 2) if p50 > 0 else float("inf")}
        warm_rows = median_breakdown(rows[1:])
        phases = {k.strip(): [rows[0][k], warm_rows.get(k)]
                  for k in rows[0] if k.startswith(DAEMON_ROWS)}
        if phases:  # the daemon's rows (its phases: ms after it took the pull), first/warm
            out[name]["phases_ms"] = phases
    return out


def median_breakdown(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per stage, the median over the rows that have it (a greeting only when the
    handshake was not cached, for one)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: round(statistics.median(r[k] for r in rows if k in r), 2) for k in keys}


def render_breakdown(per_system: dict[str, dict[str, float]]) -> str:
    names = list(per_system)
    keys: list[str] = []
    for rows in per_system.values():
        keys += [k for k in rows if k not in keys]
    head = ["stage (ms, p50)", *names]
    rows = [head] + [[k, *[str(per_system[n].get(k, "-")) for n in names]] for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def batch_landing(sent_s: float, points: dict[str, list[float]]) -> dict[str, list[float]]:
    """A batch's per-request times (ms after the batch was sent), sorted, per point."""
    return {k: sorted(round((t - sent_s) * 1000, 1) for t in v) for k, v in points.items()}


def plot(result: dict[str, Any], path: str) -> None:
    """Hand-over p50/p95 and the batch's decode time per system (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [s for s in result["summaries"] if s["system"] != "plain"]
    names = [s["system"] for s in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [s["handover_p50_ms"] or 0 for s in rows], 0.4, label="p50")
    a.bar([i + 0.2 for i in x], [s["handover_p95_ms"] or 0 for s in rows], 0.4, label="p95")
    a.set_xticks(list(x), names, rotation=20)
    a.set_ylabel("hand-over (decode TTFT), ms")
    a.legend()
    b.bar(list(x), [s["batch_decode_p50_s"] or 0 for s in rows])
    b.set_xticks(list(x), names, rotation=20)
    b.set_ylabel(f"batch of {result['config']['batch']}: decode side, s")
    fig.tight_layout()
    fig.savefig(path)
