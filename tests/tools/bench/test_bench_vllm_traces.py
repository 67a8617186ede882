"""``kvd bench vllm``'s measures from trace points: a batch's co-scheduled spread (the
requests vLLM scheduled in one decode step, their KV reported to vLLM) and the paired
tail of a request through the router (its first token after its own prefill's end)."""

from __future__ import annotations

import pytest

from kvd.tools.bench.vllm_stats import Counters, Single, render, summarize, targets
from kvd.tools.bench.vllm_traces import (
    CoScheduled,
    Paired,
    Routed,
    add_trace_measures,
    co_scheduled,
    paired_tails,
    prefill_done_s,
    step_groups,
)

STEP_S = 0.010


def _at(ms: float, point: str, rid: str) -> tuple[int, str, str, None]:
    return (round(ms * 1e6), point, rid, None)


def _points(scheduled: dict[str, float], reported: dict[str, float]) -> list:
    pts = [_at(t, "decode_scheduled", r) for r, t in scheduled.items()]
    pts += [_at(t, "recv_reported", r) for r, t in reported.items()]
    return sorted(pts)


def test_requests_scheduled_in_one_step_are_one_group_others_the_next():
    scheduled = {"a": 0.100, "b": 0.1002, "c": 0.1004, "d": 0.120, "e": 0.1201}
    assert step_groups(scheduled, STEP_S) == [["a", "b", "c"], ["d", "e"]]
    # the window is anchored at a group's first request: a chain of close points
    # does not make one group of several steps
    chain = {"a": 0.0, "b": 0.004, "c": 0.008, "d": 0.012}
    assert step_groups(chain, STEP_S) == [["a", "b"], ["c", "d"]]


def test_spread_is_taken_within_each_step_not_across_steps():
    """Two steps 20 ms apart, their KV reported 30 steps apart: each step's requests
    were reported in one step (0 steps); the client-side measure would say 30."""
    pts = _points({"a": 100.0, "b": 100.2, "c": 120.0, "d": 120.1},
                  {"a": 200.0, "b": 200.0, "c": 500.0, "d": 500.0})
    assert co_scheduled(pts, STEP_S) == CoScheduled((2, 2), 0.0, 0)


def test_requests_are_matched_by_id_not_by_sorted_order():
    """Interleaved in time: the first-scheduled request of each step is the last
    reported. Paired by sorted order (k-th scheduled, k-th reported) step one would
    spread 0.5 steps and step two none; by id step one spreads 15 ms (1.5 steps),
    step two 10 ms."""
    pts = _points({"a": 100.0, "b": 100.1, "c": 130.0, "d": 130.1},
                  {"b": 200.0, "d": 205.0, "a": 215.0, "c": 215.0})
    out = co_scheduled(pts, STEP_S)
    assert out.group_sizes == (2, 2)
    assert out.spread_steps == 1.5


def test_a_lone_request_has_no_spread_and_a_batch_of_lone_requests_no_value():
    pts = _points({"a": 100.0, "b": 150.0, "c": 150.1}, {"a": 900.0, "b": 200.0, "c": 210.0})
    assert co_scheduled(pts, STEP_S) == CoScheduled((1, 2), 1.0, 0)
    alone = _points({"a": 100.0, "b": 150.0}, {"a": 900.0, "b": 200.0})
    assert co_scheduled(alone, STEP_S) == CoScheduled((1, 1), None, 0)


def test_missing_points_are_left_out_and_counted():
    # c was scheduled with a and b but never reported; e reported but never scheduled
    # (outside the batch's window): neither is in the spread
    pts = _points({"a": 100.0, "b": 100.1, "c": 100.2}, {"a": 200.0, "b": 210.0, "e": 999.0})
    assert co_scheduled(pts, STEP_S) == CoScheduled((3,), 1.0, 1)
    # only one of a step reported: no spread to take
    pts = _points({"a": 100.0, "b": 100.1}, {"a": 200.0})
    assert co_scheduled(pts, STEP_S) == CoScheduled((2,), None, 1)
    assert co_scheduled([], STEP_S) == CoScheduled((), None, 0)
    # no decode step measured: no value
    pts = _points({"a": 100.0, "b": 100.1}, {"a": 200.0, "b": 200.0})
    assert co_scheduled(pts, 0.0).spread_steps is None


def test_a_requests_first_points_count():
    """A request scheduled again (preempted, resumed) keeps its first time."""
    pts = _points({"a": 100.0, "b": 100.1}, {"a": 200.0, "b": 200.0})
    pts = sorted([*pts, _at(300.0, "decode_scheduled", "a"), _at(400.0, "recv_reported", "b")])
    assert co_scheduled(pts, STEP_S) == CoScheduled((2,), 0.0, 0)


def test_prefill_done_is_its_last_publish_or_seal_of_one_request():
    seq = [_at(10.0, "decode_scheduled", "d1"), _at(400.0, "publish_sent", "p1"),
           _at(401.0, "pull_sent", "d1")]
    assert prefill_done_s(seq) == pytest.approx(0.400)
    prog = [_at(t, "seal_sent", "p2") for t in (100.0, 200.0, 300.0)]
    assert prefill_done_s([_at(50.0, "pull_sent", "d2"), *prog]) == pytest.approx(0.300)
    assert prefill_done_s([_at(50.0, "pull_sent", "d2")]) is None
    # two requests' ends in the window: not this request's alone
    assert prefill_done_s([*prog, _at(350.0, "publish_sent", "p3")]) is None


def test_paired_tail_is_first_token_after_the_requests_own_prefill():
    """The plain engine's TTFT swings 0.6-1.9 s between rounds: the issue's tail
    swings with it (-600 to +700 ms), the paired tail does not."""
    plain = {0: 1.0, 1: 0.6, 2: 1.9, 3: 1.2}
    routed = [Routed("kvd-1d-prog", r, 10.0 * r, 10.0 * r + prefill + 0.05,
                     10.0 * r + prefill) for r, prefill in ((0, 2.0), (1, 1.2), (2, 1.3),
                                                            (3, 1.25))]
    out = paired_tails(routed, plain)
    assert out.tail_after_prefill_p50_ms == 50.0  # round 0 (warm-up) left out
    assert out.prefill_vs_plain_p50 == pytest.approx(1.04)  # 2.0, 0.68, 1.04
    assert out.samples == 3
    # a routed request without its prefill's point, or without a plain TTFT that round
    missing = [Routed("kvd-1d", 1, 0.0, 1.0, None), Routed("kvd-1d", 2, 0.0, 1.0, 0.9)]
    assert paired_tails(missing, {1: 1.0}) == Paired(100.0, None, 1)
    assert paired_tails([], plain) == Paired(None, None, 0)


def test_trace_measures_reach_the_summary_the_targets_and_the_table():
    def summary(name: str):
        return summarize(name, [Single(name, 1, 0.1, 0.3, 2, 2)], [], {},
                         Counters(idle_cores_per_engine=0.01))

    summaries = {n: summary(n) for n in ("kvd-1d", "nixl")}
    for s in summaries.values():
        s.batch_spread_steps_max = 40.0  # client side: vLLM's server spread them
    add_trace_measures(
        summaries,
        {"kvd-1d": [CoScheduled((1, 5), 0.02, 0), CoScheduled((6,), 0.5, 0),
                    CoScheduled((1, 1), None, 0)]},
        {"kvd-1d": Paired(45.0, 1.02, 5)})
    one = summaries["kvd-1d"]
    assert one.batch_coscheduled_spread_steps_max == 0.5
    assert (one.tail_after_prefill_p50_ms, one.prefill_vs_plain_p50) == (45.0, 1.02)
    assert summaries["nixl"].batch_coscheduled_spread_steps_max is None
    verdict = targets(summaries)["batch_within_one_step"]
    assert verdict == {"client_side": {"kvd-1d": False, "nixl": False},
                       "co_scheduled": {"kvd-1d": True, "nixl": None}}
    text = render({"summaries": [vars(s) for s in summaries.values()],
                   "targets": {"batch_within_one_step": verdict},
                   "config": {"rounds": 2, "batch": 6, "batch_rounds": 1,
                              "prompt_tokens": 800, "max_tokens": 16}})
    assert "co-scheduled spread/step max" in text
    assert "target batch_within_one_step (co_scheduled): {'kvd-1d': True, 'nixl': None}" \
        in text


def test_the_daemons_part_is_pull_sent_to_event_taken_and_one_daemon_is_judged_on_it():
    """Singles: the warm rounds' p50 of pull sent -> event taken (round 0 left out);
    batches: the last event taken minus the last pull sent, the median over batches."""
    from kvd.tools.bench.vllm_traces import (
        SINGLE_KVD_PART,
        KvdPart,
        kvd_parts,
        one_daemon_not_slower_on_kvd_part,
    )

    samples = {"kvd-1d": [{SINGLE_KVD_PART: 90.0}, {SINGLE_KVD_PART: 4.0},
                          {SINGLE_KVD_PART: 6.0}, {SINGLE_KVD_PART: 5.0}],
               "kvd-2d": [{SINGLE_KVD_PART: 1.0}, {SINGLE_KVD_PART: 9.0},
                          {SINGLE_KVD_PART: 11.0}]}
    landing = [
        {"system": "kvd-1d", "pull_sent": [1.0, 9.0], "event_taken": [12.0, 14.0]},
        {"system": "kvd-1d", "pull_sent": [2.0, 3.0], "event_taken": [40.0, 3.5]},
        {"system": "kvd-1d", "pull_sent": [5.0], "event_taken": [9.0]},
        {"system": "kvd-2d", "pull_sent": [1.0], "event_taken": [31.0]},
        {"system": "kvd-2d", "pull_sent": [], "event_taken": [2.0]},  # untraced: out
    ]
    parts = kvd_parts(samples, landing)
    assert parts["kvd-1d"] == KvdPart(5.0, 5.0)  # batches: 5, 37, 4 -> 5
    assert parts["kvd-2d"] == KvdPart(10.0, 30.0)
    assert one_daemon_not_slower_on_kvd_part(parts) == {"single": True, "batch": True}
    slow = {**parts, "kvd-1d": KvdPart(10.5, 5.0)}
    assert one_daemon_not_slower_on_kvd_part(slow) == {"single": False, "batch": True}
    assert one_daemon_not_slower_on_kvd_part({"kvd-1d": parts["kvd-1d"]}) is None
    assert one_daemon_not_slower_on_kvd_part(
        {"kvd-1d": KvdPart(None, None), "kvd-2d": KvdPart(None, None)}) is None


def test_with_the_schedulers_step_in_the_points_a_step_is_a_group_exactly():
    """Run 12's batch 4 of kvd-1d: requests scheduled 10.5 ms apart in two steps, with a
    median token gap of 34 ms; half a step merged them (a spread of 1.85 steps that
    was two steps' landing). The step each point names splits them; a trace without
    steps is grouped by time as before."""
    sched = {"a": 6.3, "b": 16.8, "c": 16.9, "d": 17.0}
    reported = {"a": 17.8, "b": 81.0, "c": 81.0, "d": 81.0}
    step_of = {"a": 3.0, "b": 4.0, "c": 4.0, "d": 4.0}
    timed = _points(sched, reported)
    stepped = [(ns, point, rid, step_of[rid] if point == "decode_scheduled" else value)
               for ns, point, rid, value in timed]
    merged = co_scheduled(timed, 0.0341)
    assert merged.group_sizes == (4,) and merged.spread_steps == 1.85
    split = co_scheduled(stepped, 0.0341)
    assert split.group_sizes == (1, 3) and split.spread_steps == 0.0
    late = dict(reported, d=120.0)  # one of the step's three landed later: seen
    stepped_late = [(ns, point, rid, step_of[rid] if point == "decode_scheduled" else value)
                    for ns, point, rid, value in _points(sched, late)]
    assert co_scheduled(stepped_late, 0.0341).spread_steps == round(39.0 / 34.1, 2)


def test_the_daemons_phases_of_the_first_transfer_stand_beside_the_warm_ones():
    from kvd.tools.bench.vllm_traces import trace_measures

    def single(t0_ms: float, rid: str, greet_ms: float | None, read_ms: float) -> list:
        pts = [_at(t0_ms + 100, "pull_sent", rid), _at(t0_ms + 101, "daemon_pull", rid),
               (round((t0_ms + 101 + read_ms + 1) * 1e6), "event_taken", rid,
                (read_ms + 1) / 1000)]
        at = 0.0
        if greet_ms is not None:  # only the first: no cached handshake
            at = greet_ms / 1000
            pts.append((round((t0_ms + 120) * 1e6), "daemon_phase_handshake", rid, at))
        pts += [(round((t0_ms + 121) * 1e6), "daemon_phase_post", rid, at + 0.0005),
                (round((t0_ms + 122) * 1e6), "daemon_phase_released", rid,
                 at + read_ms / 1000)]
        return pts

    points, timelines = [], []
    for i, (greet, read) in enumerate([(9.0, 3.0), (None, 2.0), (None, 4.0), (None, 3.0)]):
        t0 = i * 1000.0
        points += single(t0, f"r{i}", greet, read)
        timelines.append(("kvd-2d", {"prefill_sent": t0 / 1000, "end": (t0 + 500) / 1000}))
    out = trace_measures(sorted(points), timelines, [], [], {})
    first = out["first_transfers"]["kvd-2d"]
    assert first["phases_ms"] == {"daemon phase handshake": [9.0, None],
                                  "daemon phase post": [9.5, 0.5],
                                  "daemon phase released": [12.0, 3.0]}
    # the warm rows' median has each phase over the rows that have it
    assert out["breakdown"]["kvd-2d"]["    daemon phase released"] == 3.0
    text = render({"summaries": [], "first_transfers": out["first_transfers"],
                   "config": {"rounds": 4, "batch": 6, "batch_rounds": 0,
                              "prompt_tokens": 800, "max_tokens": 16}})
    assert ("daemon phase handshake 9.0 / None, daemon phase post 9.5 / 0.5, "
            "daemon phase released 12.0 / 3.0") in text
