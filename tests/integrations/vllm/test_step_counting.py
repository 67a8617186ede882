"""How the whole-engine tests count an engine's steps inside time windows, from the
scheduler probe's ``.steps`` lines (engine_proc.steps_in_windows): checked against the
true schedule() calls of simulated engines, written with the probe's rule.

No vLLM needed: runs in the default suite."""

from __future__ import annotations

import random

from engine_proc import steps_in_windows

BEAT_S = 0.5  # vllm_sched_probe: a line twice a second while stepping
GAP_S = 0.05  # ... and whenever a call comes more than this after the one before


def _probe_lines(calls_s: list[float]) -> list[dict[str, float]]:
    """The lines vllm_sched_probe.RecordingScheduler writes for schedule() calls at these
    times (its rule, written again here)."""
    lines, last, beat, since = [], calls_s[0] - 1.0, calls_s[0] - 1.0, 0
    for now in calls_s:
        gap, last = now - last, now
        since += 1
        if gap > GAP_S or now - beat >= BEAT_S:
            lines.append({"t": now, "gap": gap, "steps": since})
            beat, since = now, 0
    return lines


def _rounds(rng: random.Random, rounds: int, step_s: tuple[float, float],
            window_s: tuple[float, float]) -> tuple[list[float], list[tuple[float, float]]]:
    """An engine idle between windows (no calls), stepping inside each."""
    calls, windows, t = [], [], 100.0
    for _ in range(rounds):
        t += rng.uniform(0.2, 2.0)  # idle: the other engines' turn
        start, end = t, t + rng.uniform(*window_s)
        t += rng.uniform(0.001, 0.01)  # the request reaches the scheduler
        while t < end:
            calls.append(t)
            t += rng.uniform(*step_s)
        windows.append((start, max(t, end)))
    return calls, windows


def _true(calls: list[float], windows: list[tuple[float, float]]) -> int:
    return sum(any(a <= c <= b for a, b in windows) for c in calls)


def test_fast_steps_in_short_windows_are_all_counted():
    """The case that found none: every step well under 50 ms, every window under half a
    second (a decode of a few tokens), so the probe writes a line only after each idle
    gap, when the next window has begun."""
    rng = random.Random(1)
    calls, windows = _rounds(rng, 20, (0.005, 0.02), (0.05, 0.3))
    lines = _probe_lines(calls)
    assert all(line["gap"] > GAP_S for line in lines)  # no line inside a window
    counted, slow = steps_in_windows(lines, windows)
    # the last window's steps are reported only by a line that never comes
    last = sum(windows[-1][0] <= c for c in calls)
    assert counted == _true(calls, windows) - last + 1
    assert counted > 0 and slow == []


def test_counts_never_exceed_the_calls_made_in_the_windows():
    """Long windows (heartbeat lines inside), slow steps, windows cut anywhere: never
    more than the true count, and every slow step inside a window is reported."""
    rng = random.Random(2)
    for _ in range(200):
        calls, windows = _rounds(rng, rng.randint(1, 6), (0.002, 0.12), (0.05, 2.0))
        lines = _probe_lines(calls)
        cut = [(a + rng.uniform(0, 0.3), b - rng.uniform(0, 0.3)) for a, b in windows]
        cut = [(a, b) for a, b in cut if a < b]
        counted, slow = steps_in_windows(lines, cut)
        assert 0 <= counted <= _true(calls, cut)
        want_slow = [c - p for p, c in zip(calls, calls[1:], strict=False)
                     if c - p > GAP_S and any(a <= p and c <= b for a, b in cut)]
        assert sorted(slow) == sorted(want_slow)
