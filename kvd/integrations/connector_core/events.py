"""From kvd's completion events to what vLLM's worker connector must report each step.

vLLM's rules (scheduler side of 0.32/0.33), which this book enforces:

* a finished send may be reported only for a request vLLM has already passed
  in as finished (``finished_req_ids``); kvd may report it earlier, so it waits;
* a finished receive may be reported only for a pull the scheduler announced
  (metadata), since vLLM asserts it knows the id; the daemon's event can
  overtake the metadata under async scheduling, so it waits too;
* notify-only pulls (full local prefix hit, decode aborted before it was
  scheduled) are vLLM-invisible: their events are dropped;
* a failed receive is reported as finished AND as failed (per request for
  multi-group models, per block otherwise, so a valid local prefix survives);
* the pulls the scheduler sent in one step (a batch that arrived together) land
  together: a finished receive is held until every pull of its step has an outcome,
  so vLLM schedules them in one step instead of one after another as the daemon's
  copies end (at most ``GROUP_HOLD_S`` after the first landed; failures are not held).

Nothing here talks to a socket or reads a clock: the caller passes ``now_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.wire.protocol import Event

# The longest a finished receive waits for the other pulls of its step (a lost event is
# already bounded by the pull's own deadline; this bounds what the others wait for it).
GROUP_HOLD_S = 0.5


@dataclass(frozen=True)
class StepReport:
    """What one worker step hands back to vLLM."""

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()  # per request (multi-group models)
    invalid_block_ids: frozenset[int] = frozenset()  # per block (single-group models)


@dataclass
class TransferTotals:
    """Counters since the last stats collection (vLLM's connector stats)."""

    pulls_ok: int = 0
    pulls_failed: int = 0
    sends_ok: int = 0
    sends_expired: int = 0
    nbytes: int = 0
    descriptors: int = 0
    duration_s: float = 0.0
    durations_s: list[float] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.pulls_ok or self.pulls_failed or self.sends_ok or self.sends_expired)


@dataclass
class _Recv:
    block_ids: tuple[int, ...]
    deadline_s: float


class EventBook:
    """Pairs scheduler announcements with daemon events; one per engine (rank 0 worker)."""

    def __init__(self, multi_group: bool = False) -> None:
        self.multi_group = multi_group
        self._recving: dict[str, _Recv] = {}
        self._quiet: set[str] = set()
        self._sending: dict[str, float] = {}  # published request -> deadline_s
        self._finished: set[str] = set()  # ids vLLM passed in as finished
        self._early: dict[str, Event] = {}  # done_recving that overtook its announcement
        self._sent_done: set[str] = set()
        self._report_send: set[str] = set()
        self._closed_send: set[str] = set()  # reported before their announcement arrived
        self._report_recv: dict[str, bool] = {}  # id -> ok
        self._invalid: set[int] = set()
        # pulls announced in one step: group -> the ids without an outcome yet, and the
        # finished ones held until the group is complete (with when the first landed)
        self._group_of: dict[str, int] = {}
        self._open: dict[int, set[str]] = {}
        self._held: dict[int, list[str]] = {}
        self._held_since: dict[int, float] = {}
        self.totals = TransferTotals()

    # ------------------------------------------------------------ announcements

    def announce_recv(self, request_id: str, block_ids: list[int], deadline_s: float,
                      group: int | None = None) -> None:
        """A pull the scheduler sent; ``group``: the step it was sent in (its pulls land
        together), None to report it alone."""
        self._recving[request_id] = _Recv(tuple(block_ids), deadline_s)
        if group is not None:
            self._group_of[request_id] = group
            self._open.setdefault(group, set()).add(request_id)
        early = self._early.pop(request_id, None)
        if early is not None:
            self._on_recv(early)

    def announce_step(self, recv: dict[str, list[int]], deadline_s: float,
                      group: int) -> None:
        """The pulls the scheduler sent in one step, as one group: every one is
        registered before any event that overtook its announcement is taken."""
        early = {rid: self._early.pop(rid) for rid in recv if rid in self._early}
        for rid, blocks in recv.items():
            self.announce_recv(rid, blocks, deadline_s, group)
        for ev in early.values():
            self._on_recv(ev)

    def announce_quiet(self, request_id: str) -> None:
        """A notify-only pull vLLM knows nothing about: drop its event."""
        if self._early.pop(request_id, None) is None:
            self._quiet.add(request_id)

    def announce_failed_submit(self, request_id: str, block_ids: list[int]) -> None:
        """The scheduler could not even queue the pull: fail it now."""
        self._recving.pop(request_id, None)
        self._fail_recv(request_id, block_ids)

    def pull_refused(self, request_id: str, block_ids: list[int]) -> None:
        """The daemon refused a pull announced earlier: fail it, unless its outcome was
        reported already (the restart that made the daemon refuse it also failed it,
        or it expired). vLLM must hear of each receive once: a second report for a
        request it has rescheduled kills its engine core (an assertion)."""
        if self._recving.pop(request_id, None) is not None:
            self._fail_recv(request_id, block_ids)

    def announce_send(self, request_id: str, deadline_s: float) -> None:
        if request_id in self._closed_send:
            self._closed_send.discard(request_id)
            return
        self._sending[request_id] = deadline_s
        self._maybe_report_send(request_id)

    def vllm_finished(self, request_ids: set[str]) -> None:
        """vLLM's finished ids; only published ones are kept (the set must not grow
        with every request the engine ever ran)."""
        for rid in request_ids:
            if rid in self._sending or rid in self._sent_done:
                self._finished.add(rid)
                self._maybe_report_send(rid)

    def send_refused(self, request_id: str) -> None:
        """The daemon refused the publish (the scheduler heard it a step later): the
        blocks are the engine's again once vLLM has finished the request. Ignored once
        the send's outcome is known (a daemon restart or its deadline settled it)."""
        if request_id not in self._sending or request_id in self._sent_done:
            return
        self.on_event(Event(kind="done_sending", request_id=request_id, ok=False,
                            error="publish refused"))

    def daemon_restarted(self) -> list[str]:
        """The local daemon restarted: every pull and hold it had is gone, and no event of
        theirs will come. Pulls fail now (vLLM's load-failure policy); published blocks
        are freed once vLLM has finished their request. Returns the ids."""
        lost = list(self._recving) + list(self._sending)
        for rid, recv in list(self._recving.items()):
            del self._recving[rid]
            self._fail_recv(rid, list(recv.block_ids))
        for rid in list(self._sending):
            if rid not in self._sent_done:
                self.totals.sends_expired += 1
                self._sent_done.add(rid)
                self._maybe_report_send(rid)
        self._quiet.clear()
        self._early.clear()
        for group in list(self._held):
            self._release(group)
        self._open.clear()
        self._group_of.clear()
        return lost

    # ------------------------------------------------------------ daemon events

    def on_event(self, ev: Event) -> None:
        if ev.kind == "done_sending":
            self._count_send(ev)
            self._sent_done.add(ev.request_id)
            self._maybe_report_send(ev.request_id)
            return
        if ev.request_id in self._quiet:
            self._quiet.discard(ev.request_id)
            return
        if ev.request_id not in self._recving:
            self._early[ev.request_id] = ev
            return
        self._on_recv(ev)

    def _on_recv(self, ev: Event) -> None:
        recv = self._recving.pop(ev.request_id)
        if ev.ok:
            self.totals.pulls_ok += 1
            self.totals.nbytes += ev.nbytes
            self.totals.descriptors += ev.descriptors
            self.totals.duration_s += ev.duration_s
            self.totals.durations_s.append(ev.duration_s)
            self._landed(ev.request_id)
        else:
            self._fail_recv(ev.request_id, list(ev.invalid_block_ids) or list(recv.block_ids))

    def _fail_recv(self, request_id: str, block_ids: list[int]) -> None:
        self.totals.pulls_failed += 1
        self._report_recv[request_id] = False
        if not self.multi_group:
            self._invalid.update(block_ids)
        self._leave_group(request_id)

    def _landed(self, request_id: str) -> None:
        """A receive that finished well: reported now, or with the rest of its step."""
        group = self._group_of.get(request_id)
        if group is None:
            self._report_recv[request_id] = True
            return
        self._held.setdefault(group, []).append(request_id)
        self._leave_group(request_id)

    def _leave_group(self, request_id: str) -> None:
        """``request_id`` has its outcome: release its step's held receives if it was the
        last one without."""
        group = self._group_of.pop(request_id, None)
        if group is None:
            return
        members = self._open.get(group)
        if members is not None:
            members.discard(request_id)
            if members:
                return
            del self._open[group]
        self._release(group)

    def _release(self, group: int) -> None:
        for rid in self._held.pop(group, []):
            self._report_recv[rid] = True
        self._held_since.pop(group, None)

    def _count_send(self, ev: Event) -> None:
        if ev.ok:
            self.totals.sends_ok += 1
        else:
            self.totals.sends_expired += 1

    def _maybe_report_send(self, request_id: str) -> None:
        if request_id in self._sent_done and request_id in self._finished:
            self._sent_done.discard(request_id)
            self._finished.discard(request_id)
            self._report_send.add(request_id)
            if self._sending.pop(request_id, None) is None:
                self._closed_send.add(request_id)

    # ------------------------------------------------------------ per step

    def expire(self, now_s: float) -> list[str]:
        """Give up on pulls and sends the daemon never answered (it died with them).

        A lost pull is reported failed; a lost send is reported finished, since
        no daemon that could still read the blocks is left. Returns the ids.
        """
        lost = []
        for group in list(self._held):
            since_s = self._held_since.setdefault(group, now_s)
            if now_s - since_s >= GROUP_HOLD_S:
                for rid in self._open.pop(group, set()):
                    self._group_of.pop(rid, None)  # reported alone when it lands
                self._release(group)
        for rid, recv in list(self._recving.items()):
            if now_s >= recv.deadline_s:
                del self._recving[rid]
                self._fail_recv(rid, list(recv.block_ids))
                lost.append(rid)
        for rid, deadline_s in list(self._sending.items()):
            if now_s >= deadline_s and rid not in self._sent_done:
                del self._sending[rid]
                self.totals.sends_expired += 1
                self._sent_done.add(rid)
                self._maybe_report_send(rid)
                lost.append(rid)
        return lost

    @property
    def waiting_on_daemon(self) -> bool:
        """Whether polling the daemon can change anything (skip the round trip if not)."""
        return bool(self._recving or self._sending or self._quiet or self._early)

    def take(self) -> StepReport:
        recv = frozenset(self._report_recv)
        failed = frozenset(r for r, ok in self._report_recv.items() if not ok)
        report = StepReport(
            finished_sending=frozenset(self._report_send),
            finished_recving=recv,
            failed_recving=failed if self.multi_group else frozenset(),
            invalid_block_ids=frozenset(self._invalid),
        )
        self._report_send.clear()
        self._report_recv.clear()
        self._invalid.clear()
        return report

    def take_totals(self) -> TransferTotals:
        totals, self.totals = self.totals, TransferTotals()
        return totals
