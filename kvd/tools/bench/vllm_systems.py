"""The systems ``kvd bench vllm`` compares, as data: which engines and daemons each one
runs and with which ``--kv-transfer-config``. Pure (no processes): the runner in
``vllm_run`` turns them into commands.

Every P/D system is a prefill and a decode vLLM OpenAI server on this host with the
same model, block size and KV cache size as the plain engine; only the connector
(and for kvd, the daemons behind it) differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# name -> what it is (the table's legend); order = the order of the table.
SYSTEMS: dict[str, str] = {
    "plain": "one engine, no connector (reference tokens and TTFT)",
    "kvd-1d": "kvd, both engines on one daemon (a copy inside it)",
    "kvd-2d": "kvd, two daemons on this host (host pulls: the decode's daemon copies)",
    "kvd-2d-nixl": "kvd, two daemons over NIXL READs (host_pulls = false)",
    "nixl": "vLLM's NixlConnector as shipped (NIXL progress thread on)",
    "nixl-noprog": "vLLM's NixlConnector with NIXL's progress thread off",
    # not in `all`: an A/B of the connector's idle-step wait in one run
    "kvd-1d-spin": "kvd on one daemon, empty steps not waiting for events "
                   "(kvd_idle_wait_s = 0)",
    # not in `all`: an A/B of the daemon's copy bursts in one run
    "kvd-1d-burst": "kvd on one daemon, pulls read together copied together "
                    "(copy_bursts = true)",
    # not in `all`: an A/B of the engine face's direct door in one run
    "kvd-1d-zmq": "kvd on one daemon, engines over ZMQ only (engine_direct = false)",
    # not in `all`: NixlConnector with the engine-side change kvd's connector makes
    "nixl-noprog-cap": "vLLM's NixlConnector, progress thread off, vLLM's queue readers "
                       "spinning at most 5 ms (as kvd's connector has them)",
    # not in `all`: an A/B of the connector's cap on vLLM's queue spin in one run
    "kvd-1d-vllmspin": "kvd on one daemon, vLLM's queue readers spinning their full second "
                       "(kvd_queue_spin_s = 1)",
    # not in `all` (`progressive` runs them against their sequential base)
    "kvd-1d-prog": "kvd-1d through `kvd router --progressive` (prefill and decode at once)",
    "kvd-2d-nixl-prog": "kvd-2d-nixl through `kvd router --progressive`",
}
ALL_SYSTEMS = ("plain", "kvd-1d", "kvd-2d", "kvd-2d-nixl", "nixl", "nixl-noprog")
QUICK_SYSTEMS = ("plain", "kvd-1d", "nixl-noprog")
KVD_SYSTEMS = ("kvd-1d", "kvd-2d", "kvd-2d-nixl", "kvd-1d-spin", "kvd-1d-burst", "kvd-1d-zmq",
               "kvd-1d-vllmspin", "kvd-1d-prog", "kvd-2d-nixl-prog")
# The exposed tail of a progressive pull against the sequential hand-off, side by side.
PROGRESSIVE_SYSTEMS = ("plain", "kvd-1d", "kvd-1d-prog", "kvd-2d-nixl", "kvd-2d-nixl-prog")
PROGRESSIVE_SUFFIX = "-prog"
NIXL_SYSTEMS = ("nixl", "nixl-noprog", "nixl-noprog-cap")
# The connector module that turns NIXL's progress thread off (vllm_nixl_quiet.py).
QUIET_NIXL_MODULE = "kvd.tools.bench.vllm_nixl_quiet"


@dataclass(frozen=True)
class DaemonSpec:
    name: str
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineSpec:
    name: str  # unique in the run, e.g. "kvd-1d-prefill"
    role: str  # "plain", "prefill" or "decode"
    kv_transfer_config: dict | None  # None: no connector
    daemon: str | None = None  # the DaemonSpec.name its connector talks to
    nixl_side_channel: bool = False  # NixlConnector: needs its own side-channel port


@dataclass(frozen=True)
class SystemSpec:
    name: str
    daemons: tuple[DaemonSpec, ...]
    engines: tuple[EngineSpec, ...]
    router_args: tuple[str, ...] = ()  # more `kvd router` arguments (--progressive)

    @property
    def disaggregated(self) -> bool:
        return self.name != "plain"


def parse_systems(text: str) -> tuple[str, ...]:
    """``all``, ``quick`` or names separated by commas; ``plain`` is always measured
    (it gives the reference tokens), first."""
    text = text.strip()
    if text == "all":
        names = list(ALL_SYSTEMS)
    elif text == "quick":
        names = list(QUICK_SYSTEMS)
    elif text == "progressive":
        names = list(PROGRESSIVE_SYSTEMS)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {', '.join(unknown)}; known: "
                         f"{', '.join(SYSTEMS)} (or all, quick)")
    return ("plain", *dict.fromkeys(n for n in names if n != "plain"))


def _kvd_config(engine_id: str, extra: dict | None = None) -> dict:
    return {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm",
            "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": dict(extra or {})}  # + kvd_address (the runner)


def _nixl_config(connector: str) -> dict:
    cfg: dict = {"kv_connector": connector, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    if connector != "NixlConnector":
        cfg["kv_connector_module_path"] = QUIET_NIXL_MODULE
    return cfg


def system_spec(name: str) -> SystemSpec:
    if name.endswith(PROGRESSIVE_SUFFIX) and name in SYSTEMS:
        base = system_spec(name[:-len(PROGRESSIVE_SUFFIX)])
        renamed = {d.name: d.name.replace(base.name, name, 1) for d in base.daemons}
        return SystemSpec(
            name, tuple(DaemonSpec(renamed[d.name], d.extra_args) for d in base.daemons),
            tuple(EngineSpec(e.name.replace(base.name, name, 1), e.role,
                             _kvd_config(e.name.replace(base.name, name, 1)),
                             daemon=renamed[e.daemon] if e.daemon else None)
                  for e in base.engines),
            router_args=("--progressive",))
    if name == "plain":
        return SystemSpec(name, (), (EngineSpec("plain", "plain", None),))
    if name in NIXL_SYSTEMS:
        cfg = _nixl_config({"nixl": "NixlConnector", "nixl-noprog": "QuietNixlConnector",
                            "nixl-noprog-cap": "CappedNixlConnector"}[name])
        return SystemSpec(name, (), tuple(
            EngineSpec(f"{name}-{role}", role, cfg, nixl_side_channel=True)
            for role in ("prefill", "decode")))
    if name in ("kvd-1d", "kvd-1d-spin", "kvd-1d-burst", "kvd-1d-zmq", "kvd-1d-vllmspin"):
        args = {"kvd-1d-burst": ("--set", "copy_bursts=true"),
                "kvd-1d-zmq": ("--set", "engine_direct=false")}.get(name, ())
        daemons: tuple[DaemonSpec, ...] = (DaemonSpec(f"{name}-d", args),)
        homes = {"prefill": daemons[0].name, "decode": daemons[0].name}
    elif name in ("kvd-2d", "kvd-2d-nixl"):
        extra = ("--set", "host_pulls=false") if name == "kvd-2d-nixl" else ()
        daemons = (DaemonSpec(f"{name}-dp", extra), DaemonSpec(f"{name}-dd", extra))
        homes = {"prefill": daemons[0].name, "decode": daemons[1].name}
    else:
        raise ValueError(f"unknown system {name!r}")
    extra = {"kvd-1d-spin": {"kvd_idle_wait_s": 0},
             "kvd-1d-vllmspin": {"kvd_queue_spin_s": 1}}.get(name, {})
    return SystemSpec(name, daemons, tuple(
        EngineSpec(f"{name}-{role}", role, _kvd_config(f"{name}-{role}", extra),
                   daemon=homes[role])
        for role in ("prefill", "decode")))


def engine_args(model_dir: str, port: int, kv_cache_bytes: int, max_model_len: int,
                kv_transfer_config: dict | None, max_num_batched_tokens: int = 0
                ) -> list[str]:
    """vLLM OpenAI server arguments (after ``python -m vllm.entrypoints.openai.api_server``);
    the same for every engine of the run but the port and the connector. Prefix caching
    is off everywhere, so that a prompt seen before is computed (plain, prefill) or
    loaded (decode) again, never found in a local cache."""
    args = ["--model", model_dir, "--port", str(port), "--host", "127.0.0.1",
            "--dtype", "float32", "--enforce-eager", "--block-size", "32",
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes",
            str(kv_cache_bytes), "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log"]
    if max_num_batched_tokens:  # chunked prefill, that many tokens a step (every engine)
        args += ["--enable-chunked-prefill", "--max-num-batched-tokens",
                 str(max_num_batched_tokens)]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return args


@dataclass(frozen=True)
class BenchConfig:
    systems: tuple[str, ...]
    rounds: int = 8  # single-request rounds (the first is the warm-up)
    batch: int = 6
    batch_rounds: int = 2
    prompt_tokens: int = 800
    max_tokens: int = 16
    kv_cache_bytes: int = 128 << 20
    max_model_len: int = 2048
    idle_s: float = 5.0
    start_parallel: int = 2  # engines starting at once
    start_timeout_s: float = 900.0
    daemon_start_timeout_s: float = 120.0  # each kvd serve answering (a busy host: imports)
    seed: int = 0
    breakdown: bool = False  # kvd engines write connector traces (KVD_TRACE_DIR)
    router_warm_up: bool = False  # routers hand one request over per pair before round 0
    # each engine serves a local request (no transfer) before round 0: round 0 is then
    # a warm pair's first transfer, not also each engine's first request
    engine_warm_up: bool = True
    decode_timeout_s: float = 30.0  # a decode request without its first token by then fails
    max_num_batched_tokens: int = 0  # > 0: chunked prefill of that many tokens a step
    pause_others: bool = True  # between its turns a system is paused (SIGSTOP): a quiet host
    settle_s: float = 1.0  # after a system is continued, before its turn
    hogs: int = 0  # busy loops beside the engines for the whole run (a busy host)
    model_shape: str = "tiny"  # kvd.tools.tiny_model.llama.SHAPES
