"""`kvd status`: a running daemon's engines, peers, held requests and pulls."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import msgspec

from kvd.client import KvdClient
from kvd.config import client_engine_address
from kvd.errors import ConfigError, KvdTimeoutError
from kvd.pool.shm import HUGE_PAGE_NBYTES
from kvd.wire.protocol import RankStatus, Status


def render_status(address: str | None, as_json: bool, timeout_s: float) -> str:
    """Ask the daemon at ``address`` (``host:port`` means tcp; None: KVD_ENGINE_ADDRESS or
    the default). A bad address or token file is one ``ConfigError``, not a traceback."""
    endpoint = client_engine_address(address)
    token_file = os.environ.get("KVD_AUTH_TOKEN_FILE", "")
    try:
        token = Path(token_file).read_text().strip() if token_file else ""
    except OSError as exc:
        raise ConfigError(f"KVD_AUTH_TOKEN_FILE={token_file!r}: {exc.strerror}") from exc
    try:
        with KvdClient(endpoint, timeout_s=timeout_s, token=token, ping_interval_s=0) as client:
            st = client.status()
    except KvdTimeoutError as exc:
        raise KvdTimeoutError(f"{exc}: {unanswered_hint(endpoint)}") from exc
    return format_status(st, as_json)


def unanswered_hint(endpoint: str) -> str:
    """What to try when ``endpoint`` gave no answer: ZMQ dials a closed port quietly, so
    look whether anything listens there at all."""
    where = ("--address HOST:PORT or KVD_ENGINE_ADDRESS (the daemon's engine_address; "
             "docs/operations.md, \"kvd status\")")
    if endpoint.startswith("ipc://"):
        listening = Path(endpoint[len("ipc://"):]).exists()
    else:
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1.0).close()
            listening = True
        except OSError:
            listening = False
    if not listening:
        return f"nothing listens there: start the daemon (kvd serve), or give its address " \
               f"with {where}"
    return ("something listens there but did not answer: a daemon stopped or busy "
            f"(try a longer --timeout-s), or not a kvd engine face: give it with {where}")


def format_status(st: Status, as_json: bool = False) -> str:
    """The text (or JSON) of one Status reply."""
    if as_json:
        return json.dumps(msgspec.to_builtins(st), indent=2)
    lines = [f"kvd {st.version}  daemon {st.daemon_id}  instance {st.instance_id[:12]}  "
             f"draining={st.draining}", "",
             f"engines ({len(st.engines)} ranks)"]
    lines += [f"  {e.engine_id:<24} rank {e.rank:<6} TP{e.tp_size}xPP{e.pp_size}  "
              f"{e.pool_bytes / 2**20:9.1f} MiB  pins={e.pins}  {_pages(e)}"
              f"{'  GONE' if e.gone else ''}" for e in st.engines]
    small = [e for e in st.engines if 0 < e.page_bytes < HUGE_PAGE_NBYTES]
    if small:
        lines.append(f"  WARNING: {len(small)} pool(s) on {small[0].page_bytes // 1024} KiB "
                     "pages: READs are ~20-40% slower than on 2 MiB pages (reserve huge "
                     "pages or set shm_dir to a huge-page mount: docs/operations.md)")
    lines += ["", f"peers ({len(st.peers)})"]
    lines += [f"  {p.address:<28} {p.local_engine} <- {p.remote_engine}"
              f"  instance {p.instance[:12]}"
              + (f"  path {p.path}" if p.path else "") + (f" ({p.why})" if p.why else "")
              for p in st.peers]
    lines += ["", f"held requests ({len(st.held)})"]
    lines += [f"  {h.engine_id:<20} {h.request_id:<24} {h.state:<8} blocks={h.blocks} "
              f"lease {h.lease_remaining_s:.1f}s" for h in st.held]
    lines += ["", f"pulls in flight ({len(st.pulls)})"]
    lines += [f"  {p.engine_id:<20} {p.request_id:<24} {p.state:<14} {p.path:<6} "
              f"age {p.age_s:.3f}s" for p in st.pulls]
    if st.finished_pulls:  # path local: copied inside this daemon; host: from another
        # daemon's pool files mapped here; neither took the network for the bytes
        lines += ["", f"finished pulls, last {len(st.finished_pulls)}"]
        lines += [f"  {p.engine_id:<20} {p.request_id:<24} {p.state:<14} {p.path:<6} "
                  f"{p.nbytes / 2**20:.1f} MiB{'  ' + p.error if p.error else ''}"
                  for p in st.finished_pulls]
    if st.rails:
        lines += ["", f"posting workers ({len(st.rails)})"]
        lines += [f"  {r.worker:<3} {r.rail or '(any)':<16} {r.agent:<28} reads={r.reads} "
                  f"{r.nbytes / 2**20:.1f} MiB" for r in st.rails]
    return "\n".join(lines)


def _pages(e: RankStatus) -> str:
    """Page size and backing of a rank's pool, e.g. ``pages 2 MiB (memfd_hugetlb)``."""
    if not e.page_bytes:
        return f"({e.backing})" if e.backing else ""
    size = (f"{e.page_bytes // 2**20} MiB" if e.page_bytes >= 2**20
            else f"{e.page_bytes // 1024} KiB")
    return f"pages {size} ({e.backing})"
