"""``kvd bench vllm``'s measures from the connector's trace points. Pure: no processes,
no clock.

Two measures read the connector's trace points (``--breakdown``; kvd.ops.trace), to
judge what the connector controls apart from what vLLM's server does before it:

* co-scheduled spread (``co_scheduled``): the client-side spread of a batch (first to
  last first token) starts before the connector has anything to do: vLLM's API server
  hands the N requests to the decode's scheduler over 9-380 ms, and no connector lands
  KV before vLLM scheduled its request. So the batch's requests are grouped by the
  decode step that scheduled them (``decode_scheduled`` sorted: a request joins the
  current group while within half the batch's decode step ``step_s`` of the group's
  first one; where the point carries the scheduler's step, as it does since 2026-12-07,
  the requests of one step are a group, exactly), and in each group of two or more: the
  spread of ``recv_reported`` (the connector handed the KV to vLLM) in steps; the
  batch's value is the largest over its groups. Points match by request id (the
  decode's, one in its scheduler and worker); a request with no ``recv_reported`` is
  left out (``unreported``); no group of two reported requests: None. Too wide a window
  only merges steps, so the value errs against kvd, never for it.
  docs/notes/handover-runs/ (51 batches, sorted times, no ids): one step's points lie
  within 1.8 ms, steps 7-570 ms apart, decode steps 5-190 ms; half a step merged two
  steps in two batches (steps of 84 and 187 ms). Taking the k-th scheduled as the k-th
  reported there: 0-0.02 steps in 48 batches, 1.45 in a merged one, 18 in one
  (2026-11-29-burst-ab kvd-1d round 0), None in one (no step measured), against
  client-side 0-112.
* paired tail (``Routed``, ``paired_tails``): a request through ``kvd router``: its
  first token minus the time its prefill engine finished computing its prompt (the
  prefill's ``publish_sent``, or for a progressive pull its last ``seal_sent``, the
  complete seal: both are sent from vLLM's ``request_finished``, right after the
  request's last step). The plain engine's TTFT in the same round, which the issue's
  tail (``ttft_minus_plain_p50_ms``) subtracts, varies by hundreds of ms between rounds
  on a busy CPU host; the paired tail subtracts the request's own prefill instead. Its
  companion ``prefill_vs_plain``: the prefill's compute (router send to that point) over
  the plain engine's TTFT of the round, the median: whether progressive sealing slows
  the prefill, which the paired tail alone would hide. The plain TTFT includes its first
  token's way out (a step's output, detokenising, HTTP: a few ms) that the prefill's
  point does not, so an unslowed prefill comes out slightly under 1.

A third reads the same points to judge one daemon against two (``kvd_part``): the
hand-over as the client sees it is mostly vLLM's own stages (its API server, its
scheduler, its decode step), which one daemon or two does not change and which move by
tens of ms between rounds on a 2-core host; what the daemons change is the time from
the pull sent to the event taken. So beside the issue's verdict (the client-side p50s)
the same comparison is made on that part: the warm single hand-overs' p50 of
``pull sent to event taken (all)``, and per batch, from its last pull sent to its last
event taken (how long after the last request asked for its KV the whole batch had it),
the median over batches.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvd.ops.trace import PHASE_POINT
from kvd.tools.bench.vllm_stats import (
    Batch,
    Summary,
    batch_landing,
    breakdown,
    first_transfers,
    median_breakdown,
)


def _ms(s: float) -> float:
    return round(s * 1000, 1)


TracePoint = tuple[int, str, str, float | None]  # (ns, point, request id, value)


def first_at(points: Sequence[TracePoint], name: str) -> dict[str, float]:
    """Each request id's first time (seconds) at point ``name``."""
    out: dict[str, float] = {}
    for ns, point, rid, _value in points:
        if point == name and rid not in out:
            out[rid] = ns / 1e9
    return out


def step_groups(scheduled_s: dict[str, float], step_s: float) -> list[list[str]]:
    """Request ids grouped by the decode step that scheduled them: in time order, a
    request joins the current group while within half a step of its first request."""
    groups: list[list[str]] = []
    start_s = 0.0
    for rid, t in sorted(scheduled_s.items(), key=lambda kv: kv[1]):
        if groups and t - start_s < step_s / 2:
            groups[-1].append(rid)
        else:
            groups.append([rid])
            start_s = t
    return groups


@dataclass(frozen=True)
class CoScheduled:
    """A batch's co-scheduled spread (the module's docstring has the rule)."""

    group_sizes: tuple[int, ...]  # requests per decode step, in time order
    spread_steps: float | None  # largest recv_reported spread of a group, in steps
    unreported: int  # scheduled requests with no recv_reported (left out)


def scheduler_steps(points: Sequence[TracePoint]) -> list[list[str]] | None:
    """Request ids grouped by the scheduler step their ``decode_scheduled`` names, the
    steps in order; None if any request's point has no step (a trace from before)."""
    steps: dict[str, float] = {}
    for _ns, point, rid, value in points:
        if point == "decode_scheduled" and rid not in steps:
            if value is None:
                return None
            steps[rid] = value
    groups: dict[float, list[str]] = {}
    for rid, step in steps.items():
        groups.setdefault(step, []).append(rid)
    return [groups[k] for k in sorted(groups)]


def co_scheduled(points: Sequence[TracePoint], step_s: float) -> CoScheduled:
    """The co-scheduled spread of one batch from its trace points (the batch's window)."""
    scheduled = first_at(points, "decode_scheduled")
    reported = first_at(points, "recv_reported")
    if step_s <= 0:
        return CoScheduled((len(scheduled),) if scheduled else (), None,
                           sum(r not in reported for r in scheduled))
    groups = scheduler_steps(points) or step_groups(scheduled, step_s)
    spreads = []
    for g in groups:
        times = [reported[r] for r in g if r in reported]
        if len(times) >= 2:
            spreads.append((max(times) - min(times)) / step_s)
    return CoScheduled(tuple(len(g) for g in groups),
                       round(max(spreads), 2) if spreads else None,
                       sum(r not in reported for r in scheduled))


PREFILL_DONE_POINTS = ("publish_sent", "seal_sent")


def prefill_done_s(points: Sequence[TracePoint]) -> float | None:
    """When the prefill engine finished a routed request's prompt, from the points
    between the router send and the first token: the last ``publish_sent`` or
    ``seal_sent`` (a progressive pull's complete seal), all of one request id; None
    when there is none or more than one request's (not this request's alone)."""
    done = [(ns, rid) for ns, point, rid, _value in points if point in PREFILL_DONE_POINTS]
    if not done or len({rid for _ns, rid in done}) > 1:
        return None
    return max(ns for ns, _rid in done) / 1e9


@dataclass(frozen=True)
class Routed:
    """A request through ``kvd router`` (seconds on the runner's clock)."""

    system: str
    round: int
    sent_s: float  # the client sent it to the router
    first_token_s: float
    prefill_done_s: float | None  # prefill_done_s(); None: no trace


@dataclass(frozen=True)
class Paired:
    tail_after_prefill_p50_ms: float | None
    prefill_vs_plain_p50: float | None
    samples: int  # warm routed requests with their prefill's point


def paired_tails(routed: Sequence[Routed], plain_ttft_by_round: dict[int, float],
                 warmup_rounds: int = 1) -> Paired:
    """One system's paired tail and prefill_vs_plain, medians of its warm rounds."""
    warm = [r for r in routed if r.round >= warmup_rounds and r.prefill_done_s is not None]
    tails = [r.first_token_s - r.prefill_done_s for r in warm]  # type: ignore[operator]
    ratios = [(r.prefill_done_s - r.sent_s) / plain_ttft_by_round[r.round]  # type: ignore[operator]
              for r in warm if plain_ttft_by_round.get(r.round)]
    return Paired(_ms(statistics.median(tails)) if tails else None,
                  round(statistics.median(ratios), 2) if ratios else None, len(warm))


SINGLE_KVD_PART = "pull sent to event taken (all)"  # vllm_stats.STAGES


@dataclass(frozen=True)
class KvdPart:
    """The part of a hand-over the daemons control (above), ms; None: not traced."""

    single_p50_ms: float | None
    batch_p50_ms: float | None


def kvd_part(samples: Sequence[dict[str, float]],
             landings: Sequence[dict[str, object]]) -> KvdPart:
    """From one system's breakdown samples (round 0 first, left out as the warm-up) and
    its batches' landings (ms after each batch was sent, per trace point)."""
    warm = [r[SINGLE_KVD_PART] for r in samples[1:] if SINGLE_KVD_PART in r]
    batches = []
    for b in landings:
        sent, taken = b.get("pull_sent"), b.get("event_taken")
        if isinstance(sent, list) and isinstance(taken, list) and sent and taken:
            batches.append(max(taken) - max(sent))
    return KvdPart(round(statistics.median(warm), 2) if warm else None,
                   round(statistics.median(batches), 2) if batches else None)


def kvd_parts(samples: dict[str, list[dict[str, float]]],
              landing: Sequence[dict[str, object]]) -> dict[str, KvdPart]:
    """`kvd_part` of every traced system (``breakdown_samples``, ``batch_landing``)."""
    names = dict.fromkeys([*samples, *(str(b["system"]) for b in landing)])
    return {n: kvd_part(samples.get(n, []), [b for b in landing if b["system"] == n])
            for n in names}


def one_daemon_not_slower_on_kvd_part(parts: dict[str, KvdPart]) -> dict[str, bool] | None:
    """kvd-1d against kvd-2d on the daemons' part, singles and batches (None: a system
    or its traces missing)."""
    one, two = parts.get("kvd-1d"), parts.get("kvd-2d")
    if one is None or two is None:
        return None
    out = {}
    if one.single_p50_ms is not None and two.single_p50_ms is not None:
        out["single"] = one.single_p50_ms <= two.single_p50_ms
    if one.batch_p50_ms is not None and two.batch_p50_ms is not None:
        out["batch"] = one.batch_p50_ms <= two.batch_p50_ms
    return out or None


def add_trace_measures(summaries: dict[str, Summary],
                       co: dict[str, list[CoScheduled]],
                       paired: dict[str, Paired]) -> None:
    """The trace measures into each system's summary: its batches' largest co-scheduled
    spread, its paired tail and prefill_vs_plain."""
    for name, s in summaries.items():
        spreads = [c.spread_steps for c in co.get(name, []) if c.spread_steps is not None]
        if spreads:
            s.batch_coscheduled_spread_steps_max = max(spreads)
        if name in paired:
            s.tail_after_prefill_p50_ms = paired[name].tail_after_prefill_p50_ms
            s.prefill_vs_plain_p50 = paired[name].prefill_vs_plain_p50


# A batch's points, in the order a request passes them (the breakdown's landing table).
LANDING_POINTS = ("decode_scheduled", "pull_sent", "daemon_pull", "daemon_event",
                  "daemon_event_sent", "event_taken", "recv_reported")


def trace_measures(points: Sequence[tuple[int, str, str, float]],
                   timelines: Sequence[tuple[str, dict[str, float]]],
                   batches: Sequence[Batch],
                   routed_at: Sequence[tuple[str, int, float, float]],
                   plain_ttft: dict[int, float]) -> dict[str, Any]:
    """Per kvd system: the median stage times of its warm single hand-overs, each
    batch's landing (when each request's pull was sent, its event taken, reported,
    and its first token came) and its co-scheduled spread, and the paired tail of
    its requests through the router (vllm_stats' docstring has both rules).
    ``points``: the trace points (ns, point, request id, value); ``timelines``: each
    single hand-over's client-side stamps; ``routed_at``: (system, round, sent, first
    token) of each request through the router."""
    per_system: dict[str, list[dict[str, float]]] = {}
    for name, stamps in timelines:
        if not name.startswith("kvd"):
            continue
        window = [p for p in points
                  if stamps["prefill_sent"] <= p[0] / 1e9 <= stamps["end"]]
        found = dict(stamps)
        copy_s = None
        phases: dict[str, float] = {}
        for ns, point, _rid, value in window:
            if point.startswith(PHASE_POINT):  # the daemon's own, at its report
                if value is not None:
                    phases.setdefault(point[len(PHASE_POINT):], value)
            elif point not in found:
                found[point] = ns / 1e9
                if point == "event_taken":
                    copy_s = value
        per_system.setdefault(name, []).append(breakdown(found, copy_s, phases))
    medians = {n: median_breakdown(rows[1:] or rows) for n, rows in per_system.items()}
    landing = []
    co: dict[str, list[Any]] = {}
    for b in batches:
        if not b.system.startswith("kvd"):
            continue
        window = [p for p in points if b.sent_s <= p[0] / 1e9 <= max(b.end_s)]
        c = co_scheduled(window, b.step_s)
        co.setdefault(b.system, []).append(c)
        by_point: dict[str, list[float]] = {}
        for ns, point, _rid, _value in window:
            if point in LANDING_POINTS:
                by_point.setdefault(point, []).append(ns / 1e9)
        by_point["first_token"] = list(b.first_token_s)
        landing.append({"system": b.system, "round": b.round,
                        "step_ms": round(b.step_s * 1000, 1),
                        "co_scheduled": asdict(c),
                        **batch_landing(b.sent_s, by_point)})
    routed = [Routed(name, rnd, sent_s, first_s, prefill_done_s(
        [p for p in points if sent_s <= p[0] / 1e9 <= first_s]))
        for name, rnd, sent_s, first_s in routed_at if name.startswith("kvd")]
    paired = {name: paired_tails([r for r in routed if r.system == name], plain_ttft)
              for name in dict.fromkeys(r.system for r in routed)}
    return {"breakdown": medians, "breakdown_samples": per_system,
            "first_transfers": first_transfers(per_system), "batch_landing": landing,
            "co_scheduled": co, "paired": paired,
            "routed_samples": [asdict(r) for r in routed]}
