"""``kvd bench`` and its subcommands: one front-end for every user-facing measurement.

The default command compares memcpy, raw NIXL and kvd end to end; ``posting``,
``pages`` and ``vram`` measure the posting cost per descriptor, page size against
speed, and VRAM -> VRAM through two daemons. Implementations are imported lazily so
``kvd --help`` never loads NIXL or torch.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import typer

bench_app = typer.Typer(add_completion=False, no_args_is_help=False,
                        help="Measure kvd on this machine (benchmarks, not tests).")


def _fail(message: str) -> None:
    typer.echo(f"kvd: error: {message}", err=True)
    raise typer.Exit(2)


def _report(result: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str],
            ok: bool) -> None:
    typer.echo(json.dumps(result, indent=2) if as_json else render(result))
    raise typer.Exit(0 if ok else 1)


def _check_layout(kv_layout: str) -> None:
    from kvd.planner.layout import KV_LAYOUTS

    if kv_layout not in KV_LAYOUTS:
        _fail(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    nbytes_mib: int = typer.Option(512, "--nbytes-mib", help="Request size in MiB."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repetitions per measurement."),
    skip_hetero: bool = typer.Option(False, "--skip-hetero",
                                     help="Skip the hetero TP scenarios (TP1 -> TP2, TP4 -> TP2)."),
    kv_layout: str = typer.Option("head_major", "--kv-layout",
                                  help="Pool layout of both engines: head_major (default: the "
                                       "fewest descriptors), cross_layer, kv_split or "
                                       "blocks_first."),
    shm_dir: str = typer.Option("/dev/shm", "--shm-dir",
                                help="Directory of the shm buffers and of both daemons' pools "
                                     "(e.g. a huge-page mount)."),
    curves: bool = typer.Option(False, "--curves",
                                help="Throughput vs request size (1 block .. --max-mib) and vs "
                                     "concurrent pulls (1..64)."),
    plot: str = typer.Option("", "--plot", metavar="FILE",
                             help="With --curves: draw both curves to a PNG "
                                  "(pip install 'kvd[plot]')."),
    max_mib: int = typer.Option(1024, "--max-mib",
                                help="With --curves: the largest request size in MiB."),
    posting_workers: str = typer.Option("auto", "--posting-workers",
                                        help="posting_workers of both daemons (auto or "
                                             "1..16), to compare worker counts."),
    workers_curve: bool = typer.Option(False, "--workers-curve",
                                       help="Throughput by posting workers (1, 2, 4) x size "
                                            "(32 MiB .. --max-mib) against one raw NIXL "
                                            "stream; with --plot, its PNG."),
) -> None:
    """memcpy vs raw NIXL vs kvd end to end (same bytes), and 1-block pull latency.

    Subcommands: posting (cost per descriptor), pages (page size vs speed), vram
    (VRAM -> VRAM on a GPU).
    """
    if ctx.invoked_subcommand is not None:
        return
    from kvd.errors import KvdError

    if nbytes_mib < 1 or repeats < 1 or max_mib < 1:
        _fail("--nbytes-mib, --repeats and --max-mib must be >= 1")
    _check_layout(kv_layout)
    if plot and not (curves or workers_curve):
        _fail("--plot needs --curves or --workers-curve")
    if curves and workers_curve:
        _fail("--curves and --workers-curve are separate runs: pick one")
    try:
        if workers_curve:
            from kvd.tools.bench.workers import SIZES_MIB
            from kvd.tools.bench.workers import main as workers_main

            sizes = tuple(m for m in SIZES_MIB if m <= max_mib) or (max_mib,)
            raise typer.Exit(workers_main(as_json=as_json, sizes_mib=sizes, repeats=repeats,
                                          kv_layout=kv_layout, shm_dir=shm_dir,
                                          plot_path=plot or None))
        if curves:
            from kvd.tools.bench.curves import main as curves_main

            raise typer.Exit(curves_main(as_json=as_json, max_mib=max_mib, repeats=repeats,
                                         kv_layout=kv_layout, shm_dir=shm_dir,
                                         plot_path=plot or None))
        from kvd.tools.bench.run import main as bench_main

        raise typer.Exit(bench_main(as_json=as_json, nbytes_mib=nbytes_mib, repeats=repeats,
                                    skip_hetero=skip_hetero, kv_layout=kv_layout,
                                    shm_dir=shm_dir, posting_workers=posting_workers))
    except KvdError as exc:
        _fail(str(exc))


@bench_app.command()
def curve(
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    nbytes_mib: int = typer.Option(512, "--nbytes-mib", help="Large pull size in MiB."),
    repeats: int = typer.Option(5, "--repeats", help="Large pulls per mode."),
    latency_pulls: int = typer.Option(200, "--latency-pulls", help="1-block pulls per mode."),
    handshakes: int = typer.Option(20, "--handshakes", help="Fresh ZMTP handshakes per mode."),
    shm_dir: str = typer.Option("/dev/shm", "--shm-dir", help="Directory of the pools."),
) -> None:
    """CurveZMQ on the peer face against plaintext, two daemon pairs, alternating: large
    pull throughput, 1-block pull p50/p99, handshake time."""
    if min(nbytes_mib, repeats, latency_pulls, handshakes) < 1:
        _fail("--nbytes-mib, --repeats, --latency-pulls and --handshakes must be >= 1")
    from kvd.tools.bench.curve import bench_curve, render_curve

    res = bench_curve(nbytes_mib=nbytes_mib, repeats=repeats, latency_pulls=latency_pulls,
                      handshakes=handshakes, shm_dir=shm_dir)
    _report(res, as_json, render_curve, all(res["verified"].values()))


@bench_app.command()
def posting(
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    nbytes_mib: int = typer.Option(512, "--nbytes-mib", help="Bytes moved per READ, in MiB."),
    chunks_kib: str = typer.Option("4,32", "--chunks-kib",
                                   help="Descriptor sizes in KiB, comma separated."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repetitions per case."),
) -> None:
    """Posting cost per descriptor: prepared lists vs a fresh list per READ."""
    try:
        chunks = tuple(int(c) for c in chunks_kib.split(","))
    except ValueError:
        _fail(f"--chunks-kib must be integers separated by commas, got {chunks_kib!r}")
    if nbytes_mib < 1 or repeats < 1 or min(chunks) < 1:
        _fail("--nbytes-mib, --repeats and every --chunks-kib must be >= 1")
    from kvd.tools.bench.posting import bench_posting, render_posting

    res = bench_posting(nbytes_mib=nbytes_mib, chunks_kib=chunks, repeats=repeats)
    _report(res, as_json, render_posting, all(c["verified"] for c in res["cases"]))


@bench_app.command()
def split(
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    sizes_kib: str = typer.Option(",".join(str(s) for s in (512, 1024, 2048, 4096, 8192,
                                                              16384, 32768, 65536)),
                                  "--sizes-kib", help="READ sizes in KiB, comma separated."),
    workers: int = typer.Option(2, "--workers", help="Posting workers (2..16)."),
    repeats: int = typer.Option(30, "--repeats", help="Timed READs per size and variant."),
    shm_dir: str = typer.Option("/dev/shm", "--shm-dir", help="Where both pools live."),
) -> None:
    """Where splitting a READ over posting workers starts to pay (the part threshold)."""
    try:
        sizes = tuple(int(c) for c in sizes_kib.split(","))
    except ValueError:
        _fail(f"--sizes-kib must be integers separated by commas, got {sizes_kib!r}")
    if repeats < 1 or min(sizes) < 8 or not 2 <= workers <= 16:
        _fail("--repeats must be >= 1, every --sizes-kib >= 8, --workers 2..16")
    from kvd.tools.bench.splitting import bench_split, render_split

    res = bench_split(sizes_kib=sizes, workers=workers, repeats=repeats, shm_dir=shm_dir)
    _report(res, as_json, render_split, bool(res["verified"]))


@bench_app.command()
def pages(
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    nbytes_mib: int = typer.Option(512, "--nbytes-mib", help="Buffer size in MiB."),
    chunk_kib: int = typer.Option(32, "--chunk-kib", help="Descriptor size in KiB."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repetitions per kind."),
    kinds: str = typer.Option("anon,shm,tmpfs_huge,hugetlbfs,memfd_hugetlb", "--kinds",
                              help="Memory kinds, comma separated."),
    rounds: int = typer.Option(1, "--rounds",
                               help="Measure every kind N times, rotating the order."),
    shm_dir: str = typer.Option("/dev/shm", "--shm-dir", help="Where 4 KiB shm files go."),
    huge_tmpfs_dir: str | None = typer.Option(None, "--huge-tmpfs-dir",
                                                help="A tmpfs mounted huge=always."),
    hugetlbfs_dir: str | None = typer.Option(None, "--hugetlbfs-dir",
                                               help="A hugetlbfs mount."),
) -> None:
    """Page size vs speed: memcpy and raw NIXL READ on heap, shm and huge-page memory.

    hugetlbfs and memfd_hugetlb need 2 x nbytes of reserved 2 MiB pages
    (echo 600 > /proc/sys/vm/nr_hugepages for 512 MiB).
    """
    from kvd.tools.bench.pages import KINDS, bench_pages, render_pages

    chosen = tuple(kinds.split(","))
    unknown = sorted(set(chosen) - set(KINDS))
    if unknown:
        _fail(f"--kinds: unknown {', '.join(unknown)}; known: {', '.join(KINDS)}")
    if nbytes_mib < 1 or repeats < 1 or chunk_kib < 1 or rounds < 1:
        _fail("--nbytes-mib, --chunk-kib, --repeats and --rounds must be >= 1")
    res = bench_pages(nbytes_mib=nbytes_mib, chunk_kib=chunk_kib, repeats=repeats,
                      kinds=chosen, shm_dir=shm_dir, huge_tmpfs_dir=huge_tmpfs_dir,
                      hugetlbfs_dir=hugetlbfs_dir, rounds=rounds)
    _report(res, as_json, render_pages, all(r.get("verified", True) for r in res["kinds"]))


@bench_app.command()
def vram(
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    nbytes_mib: int = typer.Option(512, "--nbytes-mib", help="Request size in MiB."),
    device: str = typer.Option("cuda", "--device",
                               help="cuda (VRAM pools), or cpu to run the same code on DRAM."),
    gpu: int = typer.Option(0, "--gpu", help="GPU index both daemons use."),
    repeats: int = typer.Option(5, "--repeats", help="Timed repetitions."),
    kv_layout: str = typer.Option("kv_split", "--kv-layout", help="Pool layout of both engines."),
    posting_workers: str = typer.Option("auto", "--posting-workers",
                                        help="posting_workers of both daemons (auto or 1-16)."),
) -> None:
    """VRAM -> VRAM: kvd with CUDA IPC pools next to raw NIXL on GPU buffers."""
    from kvd.errors import KvdError

    if device not in ("cuda", "cpu"):
        _fail(f"--device must be cuda or cpu, got {device!r}")
    _check_layout(kv_layout)
    from kvd.tools.bench.vram import render_vram, run_vram

    try:
        res = run_vram(nbytes_mib=nbytes_mib, device=device, gpu=gpu, repeats=repeats,
                       kv_layout=kv_layout, posting_workers=posting_workers)
    except KvdError as exc:
        _fail(str(exc))
    _report(res, as_json, render_vram, bool(res["verified"]))


@bench_app.command("vllm")
def vllm_bench(
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    systems: str = typer.Option(
        "all", "--systems", help="all, quick (plain, kvd-1d, nixl-noprog), progressive "
        "(plain, kvd-1d, kvd-1d-prog, kvd-2d-nixl, kvd-2d-nixl-prog) or names: plain, "
        "kvd-1d, kvd-2d, kvd-2d-nixl, nixl, nixl-noprog, kvd-1d-prog, kvd-2d-nixl-prog "
        "(plain is always run)."),
    rounds: int = typer.Option(8, "--rounds", help="Single-request rounds per system (the "
                               "first is the warm-up, reported as 'first')."),
    batch: int = typer.Option(6, "--batch", help="Requests in a concurrent batch."),
    batch_rounds: int = typer.Option(2, "--batch-rounds", help="Batches per system."),
    prompt_tokens: int = typer.Option(800, "--prompt-tokens", help="Prompt length."),
    max_tokens: int = typer.Option(16, "--max-tokens", help="Tokens generated per request."),
    idle_s: float = typer.Option(5.0, "--idle-s", help="Idle window for the CPU figure."),
    out: str = typer.Option("", "--out", metavar="FILE", help="Also write the JSON here."),
    plot_path: str = typer.Option("", "--plot", metavar="FILE",
                                  help="Draw the figures to a PNG (needs matplotlib)."),
    work_dir: str = typer.Option("", "--work-dir", help="Keep the model and every process's "
                                 "log here (default: a temporary directory, removed after "
                                 "a run that succeeded)."),
    decode_timeout_s: float = typer.Option(
        30.0, "--decode-timeout-s", help="A decode request without its first token by then "
        "counts as failed (vLLM's NixlConnector with its progress thread off can wait for "
        "the prefill engine's next step)."),
    router_warm_up: bool = typer.Option(
        False, "--router-warm-up", help="Start the routers with --warm-up and wait until "
        "each pair is warm: 'first' is then the first hand-over after the warm-up."),
    engine_warm_up: bool = typer.Option(
        True, "--engine-warm-up/--no-engine-warm-up", help="Before round 0 each engine "
        "serves one request of its own (no transfer): 'first' is then a pair's first "
        "transfer on engines already serving, not also vLLM's first request."),
    max_num_batched_tokens: int = typer.Option(
        0, "--max-num-batched-tokens", help="Chunked prefill on every engine, this many "
        "tokens a step (0: vLLM's default). Progressive systems overlap the transfer with "
        "the prefill only when a prompt takes several chunks."),
    hog: int = typer.Option(0, "--hog", help="Run this many CPU hogs (busy loops) beside "
                            "the engines for the whole run: a busy host."),
    pause_others: bool = typer.Option(
        True, "--pause-others/--no-pause-others", help="Between its turns pause each "
        "system's processes (SIGSTOP; SIGCONT for its turn), so that a turn runs with only "
        "the measured system on the CPUs (NixlConnector as shipped spins when idle)."),
    model_shape: str = typer.Option(
        "tiny", "--model-shape", help="The tiny Llama's shape: tiny (4 KiB of KV a token) or "
        "kv-heavy (64 KiB a token: on a CPU the transfer is then a larger part of the "
        "time to first token). Each engine's KV cache holds two of the longest requests, "
        "or a batch."),
    breakdown: bool = typer.Option(False, "--breakdown", help="kvd systems: where one "
                                   "hand-over's time goes, and when each request of a batch "
                                   "landed (connector traces, KVD_TRACE_DIR)."),
) -> None:
    """Whole vLLM engines: P/D through kvd (one daemon, two, two over NIXL) against vLLM's
    NixlConnector (as shipped, and with NIXL's progress thread off), and a plain engine.
    Run it from the venv that has vLLM (README's .venv-vllm)."""
    from kvd.errors import KvdError
    from kvd.tools.bench.vllm_systems import parse_systems

    if min(rounds, batch, batch_rounds, prompt_tokens, max_tokens) < 1 or rounds < 2:
        _fail("--rounds must be >= 2 (the first is the warm-up); --batch, --batch-rounds, "
              "--prompt-tokens and --max-tokens >= 1")
    if hog < 0:
        _fail("--hog must be >= 0")
    if max_tokens < 2:
        _fail("--max-tokens must be >= 2 (the decode step is the gap between two tokens)")
    try:
        names = parse_systems(systems)
    except ValueError as exc:
        _fail(str(exc))
    from kvd.tools.bench.vllm_run import BenchConfig, run_bench
    from kvd.tools.bench.vllm_stats import plot, render
    from kvd.tools.tiny_model.llama import SHAPES, kv_bytes_per_token

    if model_shape not in SHAPES:
        _fail(f"--model-shape must be one of {', '.join(SHAPES)}, got {model_shape!r}")
    max_model_len = max(2048, prompt_tokens + max_tokens + 64)
    kv_cache_bytes = max(128 << 20, kv_bytes_per_token(model_shape) * max(
        2 * max_model_len, batch * (prompt_tokens + max_tokens + 64)))
    cfg = BenchConfig(systems=names, rounds=rounds, batch=batch, batch_rounds=batch_rounds,
                      prompt_tokens=prompt_tokens, max_tokens=max_tokens, idle_s=idle_s,
                      max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                      model_shape=model_shape, breakdown=breakdown,
                      decode_timeout_s=decode_timeout_s,
                      router_warm_up=router_warm_up, engine_warm_up=engine_warm_up,
                      max_num_batched_tokens=max_num_batched_tokens, hogs=hog,
                      pause_others=pause_others)
    try:
        res = run_bench(cfg, work_dir or None)
    except KvdError as exc:
        _fail(str(exc))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=2)
    if plot_path:
        try:
            plot(res, plot_path)
        except ImportError:
            typer.echo("kvd: no plot: matplotlib is not installed", err=True)
    ok = all(s["tokens_equal"].split("/")[0] == s["tokens_equal"].split("/")[1]
             for s in res["summaries"])
    _report(res, as_json, render, ok)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(bench_app())
