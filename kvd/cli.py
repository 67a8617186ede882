"""The ``kvd`` command line.

Every command imports its implementation lazily: ``kvd --help`` and ``kvd plan``
must not pay for torch or NIXL (0.5 s budget), only ``serve``, ``demo`` and
``bench`` need them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Optional

import typer
import typer.core

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="kvd: KV-cache transfer daemon for disaggregated LLM serving.",
    # Help as Markdown, for every command and subcommand (bench's too: a group takes the
    # top level's mode). Rich markup, typer's default, ate brackets (pip install
    # 'kvd[plot]', the [kvd] table) and kept a docstring's line breaks inside a
    # paragraph, so that the panel wrapped each line again and broke it mid-phrase.
    rich_markup_mode="markdown",
)


def _flags_take_no_value() -> None:
    """typer (0.2x) shows each option's type, ``--json <bool>`` too, as if a flag took a
    value: a flag's type column stays empty here, for every command."""
    option = getattr(typer.core, "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "kvd_flags", False):
        return  # a typer that shows no type column (before 0.2x), or patched already

    def display_type_rich(self: typer.core.TyperOption, ctx: object) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.kvd_flags = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_take_no_value()


def _print_version(given: bool) -> None:
    if given:
        from kvd import __version__

        typer.echo(f"kvd {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print kvd's version and exit."),
) -> None:
    """kvd: KV-cache transfer daemon for disaggregated LLM serving."""


def _fail(message: str) -> None:
    typer.echo(f"kvd: error: {message}", err=True)
    raise typer.Exit(2)


def _guarded(debug: bool, fn: Callable[[], object]) -> None:
    """Run ``fn``: a refusal (KvdError) or any other failure is one ``kvd: error:`` line,
    naming the setting where kvd knows it; ``--debug`` shows the traceback instead."""
    from kvd.errors import KvdError

    try:
        fn()
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except KvdError as exc:
        if debug:
            raise
        _fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - one line for the user; --debug for the rest
        if debug:
            raise
        _fail(f"{type(exc).__name__}: {exc} (--debug shows where)")


@app.command()
def plan(
    kv_heads: int | None = typer.Option(None, "--kv-heads", help="Total KV heads of the model."),
    layers: int | None = typer.Option(None, "--layers", help="Total layers of the model."),
    prefill_tp: int = typer.Option(..., "--prefill-tp", help="Prefill TP size."),
    decode_tp: int = typer.Option(..., "--decode-tp", help="Decode TP size."),
    prefill_pp: int = typer.Option(1, "--prefill-pp", help="Prefill PP size."),
    decode_pp: int = typer.Option(1, "--decode-pp", help="Decode PP size."),
    prefill_layers: str | None = typer.Option(
        None, "--prefill-layers", help="Explicit prefill layer partition, e.g. 10,11,11."
    ),
    decode_layers: str | None = typer.Option(
        None, "--decode-layers", help="Explicit decode layer partition."
    ),
    mla: bool = typer.Option(False, "--mla", help="MLA: one latent cache on every rank."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    layout: str | None = typer.Option(
        None, "--layout", help="Also count NIXL descriptors of one request with this pool "
        "layout on both engines (e.g. LBHNC, head_major; comma-separated, or all)."
    ),
    tokens: int = typer.Option(8192, "--tokens", help="With --layout: request length."),
    block_size: int = typer.Option(16, "--block-size", help="With --layout: block size "
                                   "(tokens) of the prefill engine, and of the decode one "
                                   "unless --decode-block-size."),
    decode_block_size: int | None = typer.Option(None, "--decode-block-size",
                                                 help="With --layout: decode block size."),
    head_dim: int = typer.Option(128, "--head-dim", help="With --layout: head_dim "
                                 "(MLA: latent size)."),
    dtype_bytes: int = typer.Option(2, "--dtype-bytes", help="With --layout: bytes per "
                                    "element."),
    hybrid: str | None = typer.Option(
        None, "--hybrid", help="Hybrid model (attention, sliding window, Mamba): a preset "
        "(nemotron-h-8b, tiny-hybrid) or a JSON file, instead of --kv-heads/--layers; counts "
        "the descriptors of one --tokens request (0: off) with --block-size kernel blocks "
        "and --layout attention pages (LBHNC default, LBNHC or blocks_first)."
    ),
) -> None:
    """Show which bytes every decode rank reads from which prefill rank."""
    from kvd.errors import KvdError
    from kvd.tools.plan.render import render_plan_cli

    try:
        if hybrid is not None:
            from kvd.tools.plan.hybrid_render import render_hybrid_cli

            typer.echo(render_hybrid_cli(hybrid, prefill_tp, decode_tp, prefill_pp, decode_pp,
                                         prefill_layers, decode_layers, tokens, block_size,
                                         decode_block_size, as_json, layout))
            return
        if kv_heads is None or layers is None:
            _fail("--kv-heads and --layers are required (or --hybrid MODEL)")
        typer.echo(
            render_plan_cli(
                kv_heads=kv_heads,
                layers=layers,
                prefill_tp=prefill_tp,
                decode_tp=decode_tp,
                prefill_pp=prefill_pp,
                decode_pp=decode_pp,
                prefill_layers=prefill_layers,
                decode_layers=decode_layers,
                mla=mla,
                as_json=as_json,
                layout=layout,
                tokens=tokens,
                block_size=block_size,
                decode_block_size=decode_block_size,
                head_dim=head_dim,
                dtype_bytes=dtype_bytes,
            )
        )
    except KvdError as exc:
        _fail(str(exc))


def _literal(text: str) -> str:
    """``text`` as Markdown that renders it unchanged (help is Markdown; see ``app``):
    "UCX_TCP_KEEPIDLE, _KEEPINTVL, _KEEPCNT" must not turn italic."""
    return "".join("\\" + c if c in "\\`*_[]<>#" else c for c in text)


def _serve_parameters() -> list[inspect.Parameter]:
    """One option per knob of the schema (kvd.config.knobs): its flag, its type, and as
    help what the knob declares (help, choices or bounds, default). None means "not
    given" (env, file or default apply); the value is validated by kvd.config.load, so
    a flag, the environment and a file refuse a bad value with the same message."""
    from kvd.config import knobs

    params = [inspect.Parameter(
        "config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],  # noqa: UP045
        default=typer.Option(None, "--config", help="TOML config file ([kvd] table)."))]
    for knob in knobs().values():
        help_text = knob.describe()
        if knob.type is bool and knob.default:  # the flag can only turn it on
            help_text += f" Off: --set {knob.name}=false."
        help_text = _literal(f"{help_text} [default: {knob.default!r}]")
        params.append(inspect.Parameter(knob.name, inspect.Parameter.KEYWORD_ONLY,
                                        annotation=Optional[knob.type],  # noqa: UP045
                                        default=typer.Option(None, knob.flag, help=help_text)))
    params.append(inspect.Parameter(
        "set_", inspect.Parameter.KEYWORD_ONLY, annotation=list[str],
        default=typer.Option([], "--set", help="Any config field: KEY=VALUE (repeatable).")))
    params.append(inspect.Parameter(
        "debug", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
        default=typer.Option(False, "--debug", help="Show the traceback of a failed start.")))
    return params


def serve(**options: object) -> None:
    """Run the daemon (flags > KVD_* environment > config file > defaults)."""
    from kvd import config as cfgmod

    config = options.pop("config")
    debug = bool(options.pop("debug"))
    overrides: dict[str, object] = {k: v for k, v in options.items() if k != "set_"}
    for item in options["set_"]:  # type: ignore[union-attr]
        key, sep, value = str(item).partition("=")
        if not sep:
            _fail(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value

    def start() -> None:
        cfg = cfgmod.load(config, overrides=overrides)  # type: ignore[arg-type]
        from kvd.daemon.run import load_curve, load_token
        from kvd.ops.logsetup import configure_logging

        load_token(cfg)
        load_curve(cfg)
        configure_logging(cfg.log_format, cfg.log_level)
        from kvd.daemon.run import run

        raise typer.Exit(run(cfg))

    _guarded(debug, start)


serve.__signature__ = inspect.Signature(_serve_parameters())  # type: ignore[attr-defined]
serve.__annotations__ = {p.name: p.annotation for p in _serve_parameters()}
app.command()(serve)


@app.command()
def keys(
    directory: str = typer.Argument(..., help="Where to write the key files (created)."),
    name: str = typer.Option("kvd", "--name", help="File name: NAME.key (public) and "
                             "NAME.key_secret (keypair, mode 0600)."),
    force: bool = typer.Option(False, "--force", help="Replace existing files."),
) -> None:
    """Create a CURVE keypair for a daemon or an engine (docs/security.md).

    Prints the public key only."""
    from kvd.wire.curve import load_public_key, write_keypair

    def go() -> None:
        pub, sec = write_keypair(directory, name, force)
        typer.echo(f"public key {load_public_key(pub, 'key').decode()}\n"
                   f"  {pub} (public: add it to the peers' allowlist)\n"
                   f"  {sec} (secret, mode 0600: curve_secret_key_file of this daemon)")

    _guarded(False, go)


@app.command()
def status(
    address: str | None = typer.Option(None, "--address", help="Engine face of the daemon "
                                       "(host:port means tcp://host:port; default: "
                                       "KVD_ENGINE_ADDRESS or tcp://127.0.0.1:7100)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    timeout_s: float = typer.Option(3.0, "--timeout-s", help="How long to wait for an answer."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of a failure."),
) -> None:
    """Ask a running daemon for its engines, pools, peers, held requests and pulls."""
    from kvd.ops.status import render_status

    _guarded(debug, lambda: typer.echo(render_status(address, as_json, timeout_s)))


@app.command()
def demo(
    prefill_tp: int = typer.Option(2, help="Prefill TP size."),
    decode_tp: int = typer.Option(1, help="Decode TP size."),
    prefill_pp: int = typer.Option(1, help="Prefill PP size."),
    decode_pp: int = typer.Option(1, help="Decode PP size."),
    kv_heads: int = typer.Option(8, help="Total KV heads."),
    layers: int = typer.Option(16, help="Layers."),
    head_dim: int = typer.Option(128, help="Head dimension."),
    tokens: int = typer.Option(1024, help="Request length in tokens."),
    prefill_block_size: int = typer.Option(16, help="Prefill block size (tokens)."),
    decode_block_size: int = typer.Option(16, help="Decode block size (tokens)."),
    mla: bool = typer.Option(False, "--mla", help="MLA model (one latent cache)."),
) -> None:
    """Pull simulated KV on one daemon (a local copy) and between two, byte-checked.

    Two daemons on loopback with simulated engines: a same-node pull on one daemon (a
    local copy) and a pull between the two daemons (NIXL), each checked byte for byte."""
    from kvd.errors import KvdError
    from kvd.tools.demo.run import run_demo

    try:
        raise typer.Exit(run_demo(prefill_tp=prefill_tp, decode_tp=decode_tp,
                                  prefill_pp=prefill_pp, decode_pp=decode_pp, kv_heads=kv_heads,
                                  layers=layers, head_dim=head_dim, tokens=tokens,
                                  prefill_block_size=prefill_block_size,
                                  decode_block_size=decode_block_size, mla=mla))
    except KvdError as exc:
        _fail(str(exc))


@app.command()
def router(
    prefill: list[str] = typer.Option(..., "--prefill", help="Prefill server URL "
                                      "(http://host:port; repeat for round-robin)."),
    decode: list[str] = typer.Option(..., "--decode", help="Decode server URL "
                                     "(http://host:port; repeat for round-robin)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    connect_timeout_s: float = typer.Option(10.0, "--connect-timeout-s",
                                            help="Connecting to a server."),
    prefill_timeout_s: float = typer.Option(300.0, "--prefill-timeout-s",
                                            help="The whole prefill step."),
    decode_read_timeout_s: float = typer.Option(
        300.0, "--decode-read-timeout-s", help="Silence between two chunks of the decode "
        "answer."),
    api_key_env: str = typer.Option("", "--api-key-env", help="Environment variable whose "
                                    "value is sent upstream as a Bearer token."),
    warm_up: bool = typer.Option(False, "--warm-up", help="Hand one small request over "
                                 "between every prefill/decode pair as soon as both answer, "
                                 "before traffic (GET /health shows each pair's state)."),
    otel: bool = typer.Option(False, "--otel", help="Export one OpenTelemetry span per "
                              "request, the parent of the engines' and daemons' spans "
                              "(needs kvd[otel]; OTEL_EXPORTER_OTLP_ENDPOINT, "
                              "OTEL_TRACES_SAMPLER_ARG). Without it the router still "
                              "passes a trace context on."),
    progressive: bool = typer.Option(False, "--progressive", help="Send each request to "
                                     "the prefill and the decode server at once: the "
                                     "decode's kvd reads the prompt's KV while the prefill "
                                     "computes it (needs chunked prefill; docs/vllm.md)."),
    debug: bool = typer.Option(False, "--debug", help="Show the traceback of a failure."),
) -> None:
    """OpenAI-compatible P/D router for vLLM engines (docs/vllm.md).

    Prefill with max_tokens=1, then decode with the prefill's kv_transfer_params
    (vLLM's standard hand-off)."""
    import os

    def go() -> None:
        try:
            from kvd.tools.router.app import RouterConfig, run_router
        except ImportError as exc:
            _fail(f"kvd router needs aiohttp ({exc}): pip install 'kvd[router]'")
        run_router(RouterConfig(tuple(prefill), tuple(decode), connect_timeout_s,
                                prefill_timeout_s, decode_read_timeout_s,
                                os.environ.get(api_key_env, "") if api_key_env else "",
                                warm_up=warm_up, otel=otel,
                                progressive=progressive),
                   host, port)

    _guarded(debug, go)


@app.command("tiny-model")
def tiny_model(
    directory: str = typer.Argument(..., help="Where to write the model (created)."),
) -> None:
    """Write a tiny prompt-sensitive Llama that vLLM serves (10 MB, offline, seconds).

    Real seeded weights whose output depends on the whole prompt (random or dummy
    weights ignore the prompt, so identical P/D and plain outputs would prove nothing)."""

    def go() -> None:
        try:
            from kvd.tools.tiny_model.llama import build_tiny_llama

            typer.echo(build_tiny_llama(directory))
        except ImportError as exc:
            _fail(f"kvd tiny-model needs safetensors and tokenizers ({exc}): "
                  "pip install 'kvd[tiny-model]' (vLLM installs both)")

    _guarded(False, go)


def _bench_app() -> typer.Typer:
    from kvd.tools.bench.cli import bench_app

    return bench_app


app.add_typer(_bench_app(), name="bench")


if __name__ == "__main__":  # pragma: no cover
    app()
