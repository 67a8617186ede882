"""Tooling around kvd, kept apart from the product.

The product is what a deployment runs: the daemon (``kvd.daemon``), the engine API
(``kvd.client``, ``kvd.pool.shm``), the planner, the protocol, configuration and metrics.
This package holds what is used to exercise, measure and demonstrate it:

- ``demo``: ``kvd demo``, two daemons and simulated engines on one machine, byte-exact;
- ``bench``, ``bench_cli``: ``kvd bench`` and its subcommands (memcpy vs raw NIXL vs kvd);
- ``sim``: simulated engines that write and check the global KV pattern in any layout;
- ``localcluster``: start and stop ``kvd serve`` processes locally (tests, demo, bench).

It is apart so that the product never depends on it (no product module imports it;
only ``kvd.cli``'s ``demo`` / ``bench`` commands do, lazily), so that a reader can tell
at a glance what runs in production, and so that tooling can grow helpers without
widening the product's surface. Its modules use only public names of the product and
of one another.
"""
