"""A client dropped without close() must not hang the thread that collects it.

A ZMQ context collected with a socket still open hangs in ``zmq_ctx_term``: the garbage
collector clears the context's weak references to its sockets before
``Context.__del__`` runs, so its ``destroy()`` closes nothing. A client is easily left in
a reference cycle (kvd's own vLLM worker hands its client a bound method of itself as
``on_lost``); if its registration failed, no pinger thread keeps it alive either, and
whichever engine thread ran the next collection would hang for good.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import zmq

from kvd.client.sockets import OwnedSockets
from kvd.tools.localcluster import free_port

CHILD = textwrap.dedent("""
    import gc, sys
    from kvd.client import AsyncKvdClient, KvdClient, NoWaitClient

    class Owner:  # as kvd's vLLM worker: the client calls back into its owner
        def __init__(self, cls):
            if cls is NoWaitClient:
                self.client = cls(sys.argv[1])
                self.client.owner = self
            else:
                self.client = cls(sys.argv[1], timeout_s=0.2, ping_interval_s=0,
                                  on_lost=self.lost)

        def lost(self, reason):
            pass

    gc.disable()
    for cls in (KvdClient, AsyncKvdClient, NoWaitClient):
        Owner(cls)  # dropped at once: only the cycle keeps it
        gc.collect()
        print("collected", cls.__name__, flush=True)
""")


def test_clients_collected_in_a_cycle_do_not_hang_the_collector() -> None:
    """Without OwnedSockets the child hung in its first gc.collect()."""
    address = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: the sockets stay open
    out = subprocess.run([sys.executable, "-c", CHILD, address], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["collected KvdClient", "collected AsyncKvdClient",
                                          "collected NoWaitClient"], out.stdout + out.stderr


class _Owner:
    pass


def test_the_owner_collected_closes_its_sockets_and_context() -> None:
    owner = _Owner()
    owned = OwnedSockets(owner, zmq.Context())
    kept = owned.add(owned.ctx.socket(zmq.DEALER))
    gone = owned.add(owned.ctx.socket(zmq.DEALER))
    owned.close(gone)
    assert gone.closed and owned.open == [kept]
    owner.cycle = owner
    del owner
    gc.collect()
    assert kept.closed and owned.ctx.closed


def test_shut_runs_once() -> None:
    owner = _Owner()
    owned = OwnedSockets(owner, zmq.Context())
    sock = owned.add(owned.ctx.socket(zmq.DEALER))
    owned.shut()
    assert sock.closed and owned.ctx.closed
    owned.shut()  # a second close() of the client: nothing left to do
    del owner
    gc.collect()
