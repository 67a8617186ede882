"""A deterministic simulation of a kvd fleet: several daemons in one process, on one
virtual-time event loop (support.clock.VirtualLoop).

What is real and what is simulated:

* real: each pull is driven by kvd's own `kvd.daemon.pull.driver.PullDriver` (inline
  in the engine's request, then in its task: its heartbeats, deadline, quarantine,
  probes, pins, report) and its `kvd.daemon.pull.machine.Pull` (the transition table,
  every decision); each published request a `kvd.daemon.produce.held.HeldRequest` in
  the real `HeldTable`, and the producer side is the real `kvd.daemon.produce.producer.
  Producer` (publish, acquire and its wait for the publish, heartbeats, notices,
  abandon, lease expiry with the frozen-daemon postponement, engine gone); with
  ``Knobs.prog_ops``, progressive pulls too (`progressive`): kvd's real `Progressive`
  and `ProgressiveRunner` on the consumer, each range a real PullDriver pull, and the
  real Producer's seals, Watches and range holds; with ``Knobs.engine_block_tokens``,
  engines of different block sizes on real cache layouts, each pull assembled by kvd's
  planner (`layouts`); with ``Knobs.prog_local_p``, local progressive pulls (kvd's
  `LocalPeers` over the daemon's own producer, a copy on the daemon);
* fakes (`Fake*`, what that code touches): the peer table over the simulated network
  (`network.FakePeers`), the transfers over the simulated transport
  (`transport.FakeMover`, `FakeHostMaps`), the registry, clock, events and services of
  each daemon (`fakes`);
* simulated: the control network (requests and replies with delays; partitions;
  dropped, delayed, duplicated and reordered messages, in order on one connection
  unless ``Knobs.fifo`` is off; liveness that notices a silent peer after
  ``peer_liveness_timeout_s``, and a dead one at once), the transport (READs that copy
  bytes between numpy pools descriptor by descriptor, each write recorded with its
  time), the engines (publish, pull, take their events, leave and come back), the
  consumer's admission (as kvd.daemon.pull.consumer.Consumer.start) and the faults.

One loop for the whole fleet: a daemon's timers and its tasks' wakeups go through the
daemon (`Daemon.after`), so a frozen or busy daemon runs nothing (its deferred callbacks
run when it thaws) and a crashed one's tasks are never woken again. Simpler than one
loop per daemon stepped from outside, and as faithful: kvd's code waits only on timers
and on futures the fakes resolve, both of which pass through the daemon.

Everything runs on that loop's one heap of timed events with seeded `random.Random`
streams: the same (seed, fault list) gives the same run, event for event. `run(seed)`
builds the fault schedule from the seed; `run(seed, faults=...)` replays a given
(shrunk) one. Invariants are checked as the run goes (`Violation` on the first broken
one) and after quiescence (`Sim.check_quiescent`).
"""

from support.fleet.faults import FAULT_KINDS, Fault, Knobs, Violation, fault_schedule
from support.fleet.replay import fails, report, run, shrink
from support.fleet.sim import Sim

__all__ = ["FAULT_KINDS", "Fault", "Knobs", "Sim", "Violation", "fails", "fault_schedule",
           "report", "run", "shrink"]
