"""The fleet simulation's knobs and its faults: what a run is made of, drawn from its seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvd.config import Config

FAULT_KINDS = ("freeze", "crash", "partition", "msg", "read", "leave")


class Violation(AssertionError):
    """An invariant broken: the message says which, when and where."""


# ------------------------------------------------------------------ knobs and faults


@dataclass(frozen=True)
class Knobs:
    daemons: int = 3
    num_blocks: int = 12
    block_bytes: int = 16
    horizon_s: float = 4.0  # work and faults start within it
    ops: int = 10  # transfers (a publish and its pulls) the engines start
    max_faults: int = 6
    max_freeze_s: float = 3.0  # past lease_s and liveness_s
    kinds: tuple[str, ...] = FAULT_KINDS  # the faults drawn
    msg_fault_p: float = 0.5  # share of the messages a ``msg`` window hits
    # Messages keep their order on one connection (an incarnation pair), as ZMQ over TCP
    # does: a delayed one holds up those after it, and only messages on different
    # connections (another incarnation's) overtake each other. False: any may overtake.
    fifo: bool = True
    lease_s: float = 2.0
    heartbeat_interval_s: float = 0.25
    liveness_s: float = 1.0
    transfer_timeout_s: float = 4.0
    handshake_timeout_s: float = 1.0
    max_inflight_pulls: int = 6
    max_held: int = 12
    max_quarantined_pulls: int = 3
    # Daemons that share one host: pulls between two of them take the host path (the
    # producer's pool files mapped, a copy that never fails when its owner dies).
    host_daemons: tuple[int, ...] = ()
    # Progressive transfers (support.fleet.progressive): a prefill sealing its prompt in
    # chunks, read by decodes that pulled it at admission. None unless asked for, so the
    # runs of every other knob stay what they were, event for event.
    prog_ops: int = 0
    prog_preempt_p: float = 0.3  # share of prefills preempted (unsealed) mid-prompt
    prog_abort_p: float = 0.08  # share aborted mid-prompt
    prog_never_p: float = 0.08  # share never sealed at all
    prog_cancel_p: float = 0.05  # share of decodes that cancel their pull (CancelPull)
    prog_hold_s: float = 2.0  # progressive_hold_s: a seal is due within it
    block_tokens: int = 4  # tokens per block, both engines (block_bytes // it per token)
    # Engines whose blocks hold different numbers of tokens (support.fleet.layouts):
    # engine k (``e{daemon}{j}``, k = 2 * daemon + j) has ``engine_block_tokens[k % len]``
    # tokens per block, a real cache layout (drawn per seed, the same for every engine:
    # they must be compatible) and its pulls are assembled by kvd's planner, each READ a
    # byte range. Empty: every engine has ``block_tokens`` in whole-block rows, as before.
    # Progressive transfers only (``ops`` must be 0: an ordinary pull names as many
    # blocks on both sides).
    engine_block_tokens: tuple[int, ...] = ()
    # Share of progressive transfers whose decode is the prefill's neighbour on its own
    # daemon: a local pull (kvd.daemon.pull.local's LocalPeers, a copy on the daemon).
    prog_local_p: float = 0.0
    # Share of decodes whose prefix hit ends inside a prefill block (engine_block_tokens:
    # decode blocks smaller than the prefill's); kvd fails such a pull (bad_layout).
    prog_odd_hit_p: float = 0.0

    @property
    def end_s(self) -> float:
        """Every fault has healed, and every bound has run out, well before this."""
        return (self.horizon_s + 3.5 + self.transfer_timeout_s + self.lease_s * 2
                + self.liveness_s + 2.0)

    def config(self) -> Config:
        return Config(lease_s=self.lease_s, heartbeat_interval_s=self.heartbeat_interval_s,
                      peer_liveness_timeout_s=self.liveness_s,
                      transfer_timeout_s=self.transfer_timeout_s,
                      handshake_timeout_s=self.handshake_timeout_s,
                      max_inflight_pulls=self.max_inflight_pulls,
                      max_held_requests=self.max_held,
                      max_quarantined_pulls=self.max_quarantined_pulls,
                      progressive_hold_s=self.prog_hold_s)


@dataclass(frozen=True)
class Fault:
    """One injected fault. ``a``/``b``: daemon indexes (``b``: the other end of a link, or
    the engine's index on daemon ``a`` for ``leave``); ``x``: its flavour."""

    kind: str
    at_s: float
    dur_s: float
    a: int
    b: int = -1
    x: str = ""

    def __str__(self) -> str:
        where = {"partition": f"d{self.a}<->d{self.b}", "msg": f"d{self.a}<->d{self.b}",
                 "leave": f"engine {self.a}.{self.b}"}.get(self.kind, f"d{self.a}")
        what = f"{self.kind}({self.x})" if self.x else self.kind
        return f"{self.at_s:7.3f}s +{self.dur_s:.3f}s {what} {where}"


def fault_schedule(seed: int, knobs: Knobs) -> list[Fault]:
    rng = random.Random(f"faults-{seed}")
    more = random.Random(f"faults2-{seed}")  # later additions: the first stream stays
    out = []
    for _ in range(rng.randint(0, knobs.max_faults)):
        kind = rng.choice(knobs.kinds)
        at = round(rng.uniform(0.0, knobs.horizon_s), 4)
        a = rng.randrange(knobs.daemons)
        b = rng.choice([i for i in range(knobs.daemons) if i != a])
        if kind == "freeze":
            out.append(Fault(kind, at, round(rng.uniform(0.05, knobs.max_freeze_s), 4), a))
        elif kind == "crash":
            out.append(Fault(kind, at, round(rng.uniform(0.05, 2.0), 4), a,
                             x=rng.choice(["adopt", "lose"])))
        elif kind == "partition":
            out.append(Fault(kind, at, round(rng.uniform(0.05, 3.0), 4), a, b))
        elif kind == "msg":
            out.append(Fault(kind, at, round(rng.uniform(0.1, 2.0), 4), a, b,
                             x=rng.choice(["drop", "delay", "dup", "reorder"])))
        elif kind == "read":
            dur, x = round(rng.uniform(0.1, 1.5), 4), rng.choice(["stall", "fail", "late"])
            if more.random() < 0.3:  # past the lease, or the pull's deadline
                dur = round(dur * 4, 4)
            if x == "stall" and more.random() < 0.4:  # READs that never end unless severed
                x = "hang"
            out.append(Fault(kind, at, dur, a, x=x))
        elif kind == "busy":  # the loop busy under the liveness timeout; copies go on
            out.append(Fault(kind, at, round(rng.uniform(0.05, knobs.liveness_s * 0.95), 4),
                             a))
        else:
            out.append(Fault(kind, at, round(rng.uniform(0.1, 2.0), 4), a, rng.randrange(2)))
    return sorted(out, key=lambda f: f.at_s)
