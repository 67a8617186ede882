"""Fail a vLLM server at once, in one line, when its kvd is not there.

vLLM builds the connector only after the model has loaded, in processes it spawns
(engine core, workers), and its tracebacks then bury kvd's message; on a 2-core host
that is the better part of a minute. The first kvd code that runs in a vLLM server is
the import of ``kvd.integrations.vllm``: ``KVConnectorFactory.get_connector_class``
imports it while ``VllmConfig`` is being built, in the process that parses the command
line, before any engine process exists, with the ``KVTransferConfig`` in a local of the
importing frame. ``check_at_import`` takes that config from the stack, dials the engine
face once (a connect, nothing sent) and, where nothing answers, ends the process with
kvd's line as the last thing it prints and exit status 1 (``check_at_import``).

Inert wherever it does not apply: a child process (vLLM's engine core and workers
import the package too; the server's own check has run by then), an import with no
KvdConnector config on the stack (a test, a user's script), a config kvd cannot parse
(the connector reports that itself, later, with its own message).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from kvd.integrations.connector_core.settings import ConnectorConfigError, ConnectorSettings

CONNECTOR = "KvdConnector"
# A local closer to the importing frame than this many frames is vLLM's (the factory is
# 6 to 8 frames above the package's body, through importlib).
MAX_FRAMES = 40


def unreachable_line(address: str, why: str) -> str:
    """The one line an engine prints when its kvd does not answer; ``why``: what was seen."""
    return (f"KvdConnector: no kvd answered at {address} ({why}): start `kvd serve` on "
            f"this host first (its engine face must be {address}), or set kvd_address in "
            "kv_connector_extra_config to the running daemon's address")


def config_on_stack(frame: FrameType | None, max_frames: int = MAX_FRAMES) -> Any | None:
    """The nearest ``kv_transfer_config`` local naming KvdConnector, walking up from
    ``frame``; None if no frame within ``max_frames`` holds one."""
    for _ in range(max_frames):
        if frame is None:
            return None
        found = frame.f_locals.get("kv_transfer_config")
        if getattr(found, "kv_connector", None) == CONNECTOR:
            return found
        frame = frame.f_back
    return None


def why_unreachable(address: str, timeout_s: float,
                    connect: Callable[[socket.socket, Any], None] | None = None) -> str | None:
    """Dial ``address`` (``tcp://HOST:PORT`` or ``ipc://PATH``) once; None if something
    accepts, else what was seen. A refusal or a missing socket file answers at once; a
    host that drops the dial answers after ``timeout_s``."""
    connect = connect or (lambda s, target: s.connect(target))
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not os.path.exists(path):
            return f"no socket file at {path}"
        family, target = socket.AF_UNIX, path
    elif address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            return f"cannot resolve {host!r}: {exc}"
        family, _, _, _, target = infos[0]
    else:
        return None  # a transport kvd does not dial by hand: let the connector try
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            connect(s, target)
        except TimeoutError:
            return f"no answer to a connect within {timeout_s:g}s"
        except ConnectionRefusedError:
            return "connection refused: nothing listens there"
        except OSError as exc:
            return os.strerror(exc.errno) if exc.errno else str(exc)
    return None


def check(kv_transfer_config: Any,
          connect: Callable[[socket.socket, Any], None] | None = None) -> str | None:
    """kvd's line if the daemon ``kv_transfer_config`` names does not answer, else None
    (also None for a config the connector will refuse with its own message)."""
    try:
        settings = ConnectorSettings.from_vllm(kv_transfer_config)
    except ConnectorConfigError:
        return None
    why = why_unreachable(settings.address, settings.request_timeout_s, connect)
    return None if why is None else unreachable_line(settings.address, why)


def vllm_is_main(main_spec_name: str | None, argv0: str) -> bool:
    """Whether the process is vLLM's own command (``vllm serve``, ``python -m
    vllm.entrypoints...``): no user code of its own that could want to clean up."""
    if main_spec_name is not None:
        return main_spec_name.startswith("vllm.")
    return os.path.basename(argv0) == "vllm"


def check_at_import(frame: FrameType | None) -> None:
    """End the process with kvd's line if the config vLLM is importing us for names a
    kvd that does not answer; ``frame``: the importing module's (``sys._getframe()``).

    In vLLM's own command the line is printed and the process exits 1 at once: Python's
    teardown of vLLM's imports takes 2.4 to 2.7 s on a 2-core host and there is nothing
    to tear down yet (no engine process, no socket). In a user's program (``LLM(...)``)
    it raises SystemExit with the line, so its ``finally`` blocks still run."""
    if multiprocessing.parent_process() is not None:
        return
    config = config_on_stack(frame)
    if config is None:
        return
    line = check(config)
    if line is None:
        return
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if vllm_is_main(getattr(main_spec, "name", None), sys.argv[0] if sys.argv else ""):
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        os._exit(1)
    raise SystemExit(line)

