"""`kvd serve`: start a Daemon on uvloop, drain on SIGTERM, exit 0 after a clean stop."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from kvd.config import Config
from kvd.daemon.faces import is_loopback
from kvd.daemon.priority import Priority, apply_nice, log_priority
from kvd.errors import ConfigError
from kvd.wire.curve import KeyPair, load_allowlist, load_keypair

log = logging.getLogger("kvd.daemon")


def load_token(cfg: Config) -> str:
    """Read the shared token, and refuse off-loopback binds without one (unless insecure)."""
    token = ""
    if cfg.auth_token_file:
        token = Path(cfg.auth_token_file).read_text().strip()
        if len(token) < 16:
            raise ConfigError("auth_token_file: token must be at least 16 characters")
    curve = bool(cfg.curve_secret_key_file)
    exposed = [a for a, keyed in ((cfg.engine_address, curve and cfg.curve_engine_face),
                                  (cfg.peer_address, curve))
               if not is_loopback(a) and not keyed]
    if exposed and not token and not cfg.insecure:
        raise ConfigError(
            f"refusing to bind {exposed} without authentication: set auth_token_file "
            "or curve_secret_key_file (or pass --insecure to accept unauthenticated peers)")
    return token


def load_curve(cfg: Config) -> KeyPair | None:
    """This daemon's CURVE keypair (None: CURVE off), and its allowlists read once, so
    that a bad file is one error at start, not a face that refuses everyone."""
    if not cfg.curve_secret_key_file:
        return None
    keys = load_keypair(cfg.curve_secret_key_file)
    load_allowlist(cfg.curve_allowlist)
    if cfg.curve_engine_allowlist:
        load_allowlist(cfg.curve_engine_allowlist, "curve_engine_allowlist")
    return keys


async def serve(cfg: Config, on_started: Callable[[object], None] | None = None,
                priority: Priority | None = None) -> int:
    from kvd.daemon.server import Daemon

    token = load_token(cfg)
    daemon = Daemon(cfg, token=token, curve_keys=load_curve(cfg))
    await daemon.start()
    if priority is not None:
        log_priority(priority)
    # Everything made so far (imported modules, NIXL bindings, the daemon's own tables)
    # lives as long as the process: keep it out of the collector, so that a full
    # collection while many pulls are in flight scans only their objects and does not
    # hold the loop for 100+ ms (seen with 1000 pulls queued).
    gc.freeze()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: daemon.spawn(daemon.drain()))
    if daemon.curve is not None:  # SIGHUP: reload the allowlists now (key rotation)
        loop.add_signal_handler(signal.SIGHUP, daemon.curve.request_reload)
    if on_started is not None:
        on_started(daemon)
    try:
        await daemon.wait_stopped()
    finally:
        await daemon.stop()
    return 0


def run(cfg: Config) -> int:
    priority = apply_nice(cfg.cpu_nice)  # before any thread: all made later inherit it
    try:
        import uvloop

        return uvloop.run(serve(cfg, priority=priority))
    except ImportError:  # pragma: no cover - uvloop is a dependency, but not on every OS
        return asyncio.run(serve(cfg, priority=priority))
