"""Progressive pulls in the fleet simulation: prefills that seal their prompt chunk by
chunk, and decodes that pull it at admission, before anything is sealed.

What is real: on the consumer daemon, kvd's `kvd.daemon.pull.progressive.Progressive`
(every decision) carried out by its `ProgressiveRunner` (the Watch long polls, the
range pulls, the done, the Abandon, the report), each range read by the real
`PullDriver` and `Pull` as any pull (`Daemon.start_pull`); on the producer daemon, the
real `Producer.seal`, `watch`, range holds (`_hold_range`) and `OpenTable`. What is
simulated: the engines. A prefill (`ProgPub`) computes its prompt in chunks over
virtual time, writing each token's bytes into its blocks before it seals the whole
blocks computed so far; it may be preempted (its blocks freed and reused at once, an
unseal of generation + 1, the prompt computed again into new blocks with new bytes, so
a read that mixes generations is caught), aborted, or sealed complete, after which it
keeps its blocks until its done_sending. A decode (`ProgPull`) issues the pull when it
admits the request (`Consumer._start_progressive`'s admission, mirrored in `start`),
sometimes with a prefix hit of its own, sometimes cancels it (CancelPull); with
``Knobs.prog_local_p`` it may be the prefill's neighbour on its own daemon (a local pull:
the runner's and its ranges' peers are kvd's `LocalPeers`, as `Consumer.route_for`
picks). With ``Knobs.engine_block_tokens`` the two engines' blocks may hold different
numbers of tokens (support.fleet.layouts): a seal still covers whole prefill blocks, a
prefix hit is cut to whole blocks of both, and an ok is checked token by token.

The checks, as the run goes: a progressive pull reports once, in a final state, with no
range of it still in flight; ok only with exactly the bytes of the prefill's complete
generation in every local block (never a mix, never stale), failed with every local
block invalid; no READ of a range writes into its blocks after it, or its range pull,
reported (transport.Transport.write). After quiescence (`check_quiescent`): no
progressive hold, range hold, Watch or runner left, and every prefill's blocks given
back to its engine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvd.daemon.pull.progressive import Progressive, ProgressiveRunner, ProgState
from kvd.errors import KvdError, ProtocolError
from kvd.wire import protocol as P
from support.fleet import layouts
from support.fleet.daemon import PubRec, PullRec

if TYPE_CHECKING:
    from support.fleet.daemon import Daemon, SimEngine
    from support.fleet.fakes import FakeEngine
    from support.fleet.sim import Sim

PAUSE_S = (0.01, 0.25)  # between two chunks of a prefill
PREEMPTED_S = (0.05, 0.6)  # a preempted prefill waits this long to be scheduled again
PREEMPT_AFTER_S = (0.0002, 0.01)  # a preemption this soon after a seal: READs of it run


@dataclass(eq=False)
class ProgPub(PubRec):
    """A prefill sealing its prompt as it computes it (ground truth, not kvd's)."""

    tokens: int = 0
    consumers: int = 1
    generation: int = 0
    computed: int = 0  # tokens computed in this generation
    sealed: int = -1  # tokens sealed in this generation (-1: none yet)
    preempts: int = 0  # preemptions still to come
    abort_step: int = -1  # the chunk it is aborted at (-1: never)
    steps: int = 0

    @property
    def label(self) -> str:
        return f"prefill#{self.uid}({self.engine.name}:{self.request_id})"


@dataclass(eq=False)
class ProgPull(PullRec):
    """A decode's progressive pull (ground truth); its range pulls are `PullRec`s whose
    ``parent`` it is."""

    skip: int = 0  # blocks of the engine's own prefix hit: not pulled
    hit: int = 0  # its tokens
    tokens: int = 0  # the prompt's
    producer: SimEngine | None = None  # its prefill's engine
    reg: FakeEngine | None = None  # the registration whose blocks it fills
    prog: Progressive | None = None  # kvd's record of it, once its daemon took it
    children: list[PullRec] = field(default_factory=list)


class RangeEvents:
    """Where a range pull reports: its runner (`answer`); the last event kept for the
    report's checks (`Daemon.on_reported`)."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.last: P.Event | None = None

    def push(self, engine_id: str, event: P.Event) -> None:
        self.last = event
        self.answer.push(engine_id, event)  # type: ignore[attr-defined]


class ProgressiveWork:
    """The progressive transfers of one run: planned from the seed, on a stream of their
    own (none at all unless ``Knobs.prog_ops``: every other run is as it was)."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.rng = random.Random(f"prog-{sim.seed}")
        self.data_rng = np.random.default_rng([sim.seed, 7])
        self.pubs: dict[str, ProgPub] = {}  # by request id
        for _ in range(sim.knobs.prog_ops):
            sim.at(self.rng.uniform(0.0, sim.knobs.horizon_s), self._transfer,
                   random.Random(self.rng.getrandbits(64)))

    def _transfer(self, rng: random.Random) -> None:
        """One prefill and its one or two decodes, each decision drawn from ``rng``."""
        sim, k = self.sim, self.sim.knobs
        engines = sim._engines()
        prod = rng.choice(engines)
        others = [e for e in engines if e.daemon is not prod.daemon]
        cons = rng.sample(others, 2 if rng.random() < 0.15 else 1)
        if k.prog_local_p and rng.random() < k.prog_local_p:  # its neighbour: a local pull
            cons[0] = next(e for e in prod.daemon.engines if e is not prod)
        n = rng.randint(1, 4)
        tokens = n * prod.block_tokens - rng.randrange(prod.block_tokens)
        rid = f"p{next(sim.uids)}"
        for c in cons:
            skip = rng.randrange(n) if rng.random() < 0.2 else 0
            cancel_s = rng.uniform(0.05, 2.0) if rng.random() < k.prog_cancel_p else None
            odd = bool(k.prog_odd_hit_p) and rng.random() < k.prog_odd_hit_p
            sim.at(sim.now + rng.uniform(0.0, 0.01), self._issue, c, prod, rid, tokens, skip,
                   cancel_s, odd)
        if rng.random() >= k.prog_never_p:  # else nobody ever seals it: the hold timeout
            sim.at(sim.now + rng.uniform(0.0, 0.3), self._prefill, prod, rid, n, tokens,
                   len(cons), rng)

    # ------------------------------------------------------------ the prefill

    def _prefill(self, e: SimEngine, rid: str, n: int, tokens: int, consumers: int,
                 rng: random.Random) -> None:
        sim, k = self.sim, self.sim.knobs
        free = e.free_blocks()
        if e.reg is None or e.away or not e.daemon.up or len(free) < n:
            if sim.trace is not None:
                sim.note(f"{e.name} computes {rid} without kvd (no room or no daemon)")
            return  # its decodes' pulls time out
        pub = ProgPub(next(sim.uids), e, rid, free[:n], e.reg, tokens=tokens,
                      consumers=consumers, computing=True)
        if rng.random() < k.prog_preempt_p:
            pub.preempts = 2 if rng.random() < 0.3 else 1
        if rng.random() < k.prog_abort_p:
            pub.abort_step = rng.randint(1, n + 1)
        for b in pub.blocks:
            e.owner[b] = pub
        e.pubs[rid] = pub
        sim.pubs.append(pub)
        self.pubs[rid] = pub
        sim.after(rng.uniform(*PAUSE_S), self._step, pub, rng)

    def _alive(self, pub: ProgPub) -> bool:
        """Its engine still runs it: not lost with its daemon, not left."""
        e = pub.engine
        return e.pubs.get(pub.request_id) is pub and e.reg is pub.reg

    def _step(self, pub: ProgPub, rng: random.Random) -> None:
        """One chunk: its tokens' bytes written, then the whole blocks so far sealed (all
        of them, complete, at the prompt's end); or the prefill preempted or aborted."""
        if not self._alive(pub):
            return
        sim, e = self.sim, pub.engine
        bs = e.block_tokens
        pub.steps += 1
        if pub.steps == pub.abort_step:
            self._seal(pub, [], 0, abort=True)
            self._end(pub)
            return
        assert e.pool is not None
        per_token = sim.knobs.block_bytes // bs
        start, end = pub.computed, min(pub.tokens, pub.computed + rng.randint(1, 2 * bs))
        for t in range(start, end):  # new bytes: every generation's differ
            if sim.layout is not None:  # the token's cells, wherever its layout puts them
                layouts.write_token(e.pool, sim.layout, bs, pub.blocks[t // bs], t % bs,
                                    self.data_rng.integers(0, 256, layouts.TOKEN_BYTES,
                                                           np.uint8))
                continue
            e.pool[pub.blocks[t // bs], t % bs * per_token:(t % bs + 1) * per_token] = \
                self.data_rng.integers(0, 256, per_token, np.uint8)
        pub.computed = end
        if end == pub.tokens:
            pub.expected = e.pool[pub.blocks].copy()
            self._seal(pub, pub.blocks, end, complete=True)
            self._end(pub)
            return
        sealed = end // bs * bs
        if sealed > pub.sealed:
            self._seal(pub, pub.blocks[:sealed // bs], sealed)
        if pub.preempts and rng.random() < 0.4:  # soon after its seal: a range being read
            sim.after(rng.uniform(*PREEMPT_AFTER_S), self._preempt, pub, rng)
        else:
            sim.after(rng.uniform(*PAUSE_S), self._step, pub, rng)

    def _preempt(self, pub: ProgPub, rng: random.Random) -> None:
        """As the vLLM connector's unseal: a Seal of the next generation, sealing nothing;
        the blocks are freed and reused at once (scribbled), the prompt computed again
        into the blocks the engine gives it when it is scheduled again."""
        if not self._alive(pub):
            return
        pub.preempts -= 1
        pub.generation += 1
        pub.computed, pub.sealed = 0, -1
        self._seal(pub, [], 0)
        pub.engine.give_back(pub, scribble=True)
        self.sim.after(rng.uniform(*PREEMPTED_S), self._resume, pub, rng)

    def _resume(self, pub: ProgPub, rng: random.Random) -> None:
        if not self._alive(pub):
            return
        e = pub.engine
        free = e.free_blocks()
        if len(free) < len(pub.blocks):  # no room to compute it again: the engine aborts
            self._seal(pub, [], 0, abort=True)
            self._end(pub)
            return
        pub.blocks = free[:len(pub.blocks)]
        for b in pub.blocks:
            e.owner[b] = pub
        self._step(pub, rng)

    def _end(self, pub: ProgPub) -> None:
        """The prefill is over: an aborted one frees its blocks at once, a complete one once
        its done_sending came (maybe already: its hold ended before it was complete)."""
        pub.computing = False
        if pub.ended or pub.expected is None:
            pub.ended = True
            del pub.engine.pubs[pub.request_id]
            pub.engine.give_back(pub, scribble=True)

    def _seal(self, pub: ProgPub, blocks: list[int], tokens: int, complete: bool = False,
              abort: bool = False) -> None:
        """A Seal through the engine face (its reply unread, as the connector's); a refused
        complete one leaves the blocks to the engine, which heard the refusal."""
        sim, e = self.sim, pub.engine
        d = e.daemon
        msg = P.Seal(engine_id=e.name, request_id=pub.request_id, block_ids=list(blocks),
                     num_tokens=tokens, generation=pub.generation, complete=complete,
                     abort=abort, consumers=pub.consumers)
        if not abort:
            pub.sealed = tokens

        def handle() -> None:
            if sim.trace is not None:
                sim.note(f"{d.instance} seal {pub.label} gen {msg.generation} {tokens} tokens"
                         f"{' complete' if complete else ''}{' abort' if abort else ''}")
            try:
                d.producer.seal(msg)
            except ProtocolError as exc:  # the engine's seals are well formed: kvd's bug
                sim.violate(f"{pub.label}: seal refused: {exc}")
            except KvdError:
                if complete and e.pubs.get(pub.request_id) is pub:
                    del e.pubs[pub.request_id]
                    pub.ended = True
                    e.give_back(pub, scribble=True)

        d.engine_face(handle)

    # ------------------------------------------------------------ the decode

    def _issue(self, c: SimEngine, prod: SimEngine, rid: str, tokens: int, skip: int,
               cancel_s: float | None, odd: bool = False) -> None:
        """The decode admits the request: its progressive pull, before anything is sealed.
        ``skip``: prefill blocks of its own prefix hit, cut to whole blocks of both engines
        (kvd refuses a hit that ends inside a prefill block), then counted in its own;
        ``odd``: one decode block more, inside a prefill block where that can be (kvd
        fails the pull: bad_layout)."""
        sim, d = self.sim, c.daemon
        unit = math.lcm(c.block_tokens, prod.block_tokens)
        hit = skip * prod.block_tokens // unit * unit
        if odd and c.block_tokens < prod.block_tokens and hit + c.block_tokens < tokens:
            hit += c.block_tokens
        skip = hit // c.block_tokens
        count = -(-tokens // c.block_tokens) - skip
        free = c.free_blocks()
        if c.reg is None or c.away or not d.up or rid in c.pulls or len(free) < count:
            return
        local = free[:count]
        rec = ProgPull(next(sim.uids), c, d, d.inc, rid, prod.name, rid, local, None,
                       sim.now, (prod.daemon.instance, prod.name, rid), skip=skip,
                       hit=hit, tokens=tokens, producer=prod)
        for b in local:
            c.owner[b] = rec
        c.pulls[rid] = rec
        sim.pulls.append(rec)
        msg = P.Pull(engine_id=c.name, request_id=rid, remote_engine_id=prod.name,
                     remote_address=prod.daemon.addr, remote_block_ids=[],
                     local_block_ids=local, num_tokens=tokens, progressive=True)
        d.engine_face(lambda: self._start(d, rec, msg))
        if cancel_s is not None:
            sim.after(cancel_s, self._cancel, rec)

    def _cancel(self, rec: ProgPull) -> None:
        """The decode aborted the request (Consumer.cancel): the report still comes."""
        d = rec.daemon
        if rec.consumer.pulls.get(rec.request_id) is not rec or d.inc != rec.inc:
            return

        def handle() -> None:
            runner = d.progressive.get((rec.consumer.name, rec.request_id))
            if runner is not None:
                runner.cancel()

        d.engine_face(handle)

    def _start(self, d: Daemon, rec: ProgPull, msg: P.Pull) -> None:
        """Consumer._start_progressive's admission, then the real Progressive and its
        ProgressiveRunner over this daemon's fakes; each range pull through
        `Daemon.start_pull`, as Consumer.start."""
        sim, cfg = self.sim, self.sim.cfg
        try:
            reg = d.admit(msg, len(d.drivers) + len(d.progressive))
            prog = Progressive(msg=msg, local_block_tokens=reg.layout.block_size_tokens,
                               started_s=sim.now,
                               hold_timeout_s=msg.hold_timeout_s or cfg.progressive_hold_s)
        except KvdError:
            rec.outcome, rec.outcome_s = "refused", sim.now
            rec.consumer.pulls.pop(rec.request_id, None)
            rec.consumer.give_back(rec, scribble=False)
            return
        rec.accepted, rec.reg, rec.prog = True, reg, prog
        local = msg.remote_address == d.addr  # Consumer.route_for: its own producer side
        runner = ProgressiveRunner(
            prog, d.local_peers if local else d.peers, d.svc, reg,
            lambda child, answer: self._start_range(d, rec, child, answer),
            lambda p, event: self._reported(d, rec, p, event))
        d.progressive[prog.key] = runner
        if sim.trace is not None:
            sim.note(f"{d.instance} {rec.label} starts (progressive{', local' if local else ''})")
        runner.task = d.spawn(runner.run())

    def _start_range(self, d: Daemon, parent: ProgPull, msg: P.Pull, answer: object) -> None:
        sim = self.sim
        child = PullRec(next(sim.uids), parent.consumer, d, d.inc, msg.request_id,
                        parent.producer_engine, msg.remote_request_id,
                        list(msg.local_block_ids), None, sim.now,
                        (sim.by_addr[msg.remote_address].instance, parent.producer_engine,
                         msg.remote_request_id), parent=parent)
        child.big = self.rng.random() < 0.3
        parent.children.append(child)
        sim.pulls.append(child)
        d.start_pull(child, msg, RangeEvents(answer))

    def _reported(self, d: Daemon, rec: ProgPull, prog: Progressive, event: P.Event) -> None:
        """Consumer._start_progressive's report, and the simulation's checks of it."""
        sim = self.sim
        d.progressive.pop(prog.key, None)
        if sim.trace is not None:
            sim.note(f"{d.instance} {rec.label} reported {prog.state.value} {event.error} "
                     f"(ranges {prog.ranges}, rereads {prog.rereads})")
        if rec.outcome:
            sim.violate(f"{rec.label} got a second outcome ({rec.outcome}, then "
                        f"{'ok' if event.ok else 'failed'})")
        rec.outcome, rec.outcome_s = ("ok" if event.ok else "failed"), sim.now
        if prog.state not in (ProgState.DONE, ProgState.FAILED):
            sim.violate(f"{rec.label} reported in state {prog.state.value}")
        running = [c.label for c in rec.children if not c.outcome]
        if running:
            sim.violate(f"{rec.label} reported while its range pulls {running} run")
        if event.ok:
            pub = self.pubs.get(rec.remote_rid)
            assert rec.reg is not None
            if pub is None or pub.expected is None:
                sim.violate(f"{rec.label} reported ok but its prefill never sealed it complete")
            elif not self._exact(rec, pub):
                sim.violate(f"{rec.label} reported ok with wrong bytes (generation "
                            f"{pub.generation} of {pub.label} complete)")
        elif sorted(event.invalid_block_ids) != sorted(rec.local_blocks):
            sim.violate(f"{rec.label} failed with blocks {event.invalid_block_ids} invalid, "
                        f"not its {rec.local_blocks}")
        d.svc.events.push(rec.consumer.name, event)

    def _exact(self, rec: ProgPull, pub: ProgPub) -> bool:
        """The decode's blocks hold the prefill's complete generation: whole blocks, or
        with engine_block_tokens every token of the prompt past the hit, cell by cell."""
        assert rec.reg is not None and pub.expected is not None
        layout = self.sim.layout
        if layout is None:
            return bool(np.array_equal(rec.reg.pool[rec.local_blocks], pub.expected[rec.skip:]))
        return layouts.same_tokens(layout, rec.reg.pool, rec.local_blocks,
                                   rec.consumer.block_tokens, pub.expected,
                                   pub.engine.block_tokens, rec.hit, rec.tokens)

    # ------------------------------------------------------------ quiescence

    def check_quiescent(self) -> None:
        sim = self.sim
        for d in sim.daemons:
            if not d.up:
                continue
            prod = d.producer
            if prod.opened.items:
                sim.violate(f"{d.instance} still holds progressively {list(prod.opened.items)}")
            if prod._ranges or prod._watchers:
                sim.violate(f"{d.instance}: range holds {list(prod._ranges)} or Watches "
                            f"{list(prod._watchers)} left")
            if d.progressive:
                sim.violate(f"{d.instance} still runs progressive pulls {list(d.progressive)}")
        for pub in self.pubs.values():
            e = pub.engine
            if e.pubs.get(pub.request_id) is pub and e.reg is pub.reg and e.daemon.up:
                sim.violate(f"{pub.label}: its blocks never came back to its engine (no "
                            "done_sending)")
