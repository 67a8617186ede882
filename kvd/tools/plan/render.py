"""`kvd plan` output: a table for people, the issue's JSON shape for scripts."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from kvd.errors import LayoutError, PlanError
from kvd.planner.descriptors import build_read_descriptors
from kvd.planner.layout import ALL_KV_LAYOUTS, VLLM_LAYOUTS, CacheLayout, vllm_head_layout
from kvd.planner.plan import RankId, TransferPlan, plan_transfer
from kvd.planner.topology import ModelGeometry, Parallelism, heads_per_rank, partition, stage_layers


def parse_partition(text: str | None, role: str) -> tuple[int, ...] | None:
    """"10,11,11" -> (10, 11, 11); sums and stage counts are checked by the planner."""
    if text is None or text.strip() == "":
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PlanError(
            f"bad {role} layer partition {text!r}: expected comma-separated integers like 10,11,11"
        ) from None


def _span(r: tuple[int, int]) -> str:
    return f"[{r[0]},{r[1]})"


def render_table(plan: TransferPlan) -> str:
    """One line per read, grouped by decode rank, then the consumer counts."""
    m = plan.model
    heads = "MLA latent" if m.mla else f"{m.num_kv_heads} KV heads"
    lines = [
        f"model: {heads}, {m.num_layers} layers",
        f"prefill: TP {plan.prefill.tp_size} x PP {plan.prefill.pp_size} "
        f"(layers per stage {list(partition(m, plan.prefill))})",
        f"decode:  TP {plan.decode.tp_size} x PP {plan.decode.pp_size} "
        f"(layers per stage {list(partition(m, plan.decode))})",
        f"{plan.num_reads} reads",
        "",
    ]
    header = ("decode tp/pp", "<- prefill tp/pp", "heads", "local heads", "remote heads", "layers")
    rows = []
    for rank, reads in plan.reads.items():
        for i, read in enumerate(reads):
            rows.append((
                rank.key if i == 0 else "",
                read.remote.key,
                _span(read.heads),
                _span(read.local_heads),
                _span(read.remote_heads),
                _span(read.layers),
            ))
        if not reads:
            rows.append((rank.key, "-", "", "", "", ""))
    widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]
    for row in (header, *rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    lines.append("")
    lines.append("consumers (reads that notify each prefill rank):")
    lines.append("  " + "  ".join(f"{r.key}={n}" for r, n in plan.consumers.items()))
    return "\n".join(lines)


@dataclass(frozen=True)
class RequestShape:
    """One request for `kvd plan --layout`: what it costs in descriptors per decode rank."""

    tokens: int
    prefill_block_size: int
    decode_block_size: int
    head_dim: int
    dtype_nbytes: int


def _rank_cache(plan: TransferPlan, par: Parallelism, pp_rank: int, kv_layout: str, bs: int,
                num_blocks: int, req: RequestShape) -> tuple[CacheLayout, int]:
    l0, l1 = stage_layers(plan.model, par, pp_rank)
    head_layout = vllm_head_layout(kv_layout) if kv_layout in VLLM_LAYOUTS else "HND"
    return CacheLayout(num_layers=l1 - l0, num_blocks=num_blocks, block_size_tokens=bs,
                       num_heads=heads_per_rank(plan.model, par), head_dim=req.head_dim,
                       dtype_nbytes=req.dtype_nbytes, kv_layout=kv_layout,
                       head_layout=head_layout, mla=plan.model.mla), l0


def descriptor_counts(plan: TransferPlan, kv_layout: str, req: RequestShape
                      ) -> dict[RankId, tuple[int, int]]:
    """(descriptors, bytes) per decode rank for one request, both engines in kv_layout.

    Block ids are shuffled and never adjacent (even ids of a pool twice the request), the
    worst case for merging and what a long-running engine's block tables look like, so
    the counts do not depend on luck.
    """
    if kv_layout not in ALL_KV_LAYOUTS:
        raise LayoutError(f"unknown layout {kv_layout!r}, expected all or one of "
                          f"{', '.join(ALL_KV_LAYOUTS)}")
    for flag, value in (("--tokens", req.tokens), ("--block-size", req.prefill_block_size),
                        ("--decode-block-size", req.decode_block_size),
                        ("--head-dim", req.head_dim), ("--dtype-bytes", req.dtype_nbytes)):
        if value < 1:
            raise LayoutError(f"{flag} must be >= 1, got {value}")
    rng = np.random.default_rng(0)
    n_p = -(-req.tokens // req.prefill_block_size)
    n_d = -(-req.tokens // req.decode_block_size)
    remote_ids, local_ids = 2 * rng.permutation(n_p), 2 * rng.permutation(n_d)
    out = {}
    for d_rank, reads in plan.reads.items():
        local, first = _rank_cache(plan, plan.decode, d_rank.pp_rank, kv_layout,
                                   req.decode_block_size, 2 * n_d, req)
        count = nbytes = 0
        for read in reads:
            remote, rfirst = _rank_cache(plan, plan.prefill, read.remote.pp_rank, kv_layout,
                                         req.prefill_block_size, 2 * n_p, req)
            desc = build_read_descriptors(read, local, first, remote, rfirst, local_ids,
                                          remote_ids)
            count += len(desc)
            nbytes += desc.total_nbytes
        out[d_rank] = (count, nbytes)
    return out


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def render_descriptors(plan: TransferPlan, layouts: tuple[str, ...], req: RequestShape) -> str:
    """Descriptors per decode rank for one layout, or one line per layout to compare them."""
    what = f"layout {layouts[0]}" if len(layouts) == 1 else "each layout"
    lines = [f"NIXL descriptors, {what}, one {req.tokens}-token request: prefill blocks of "
             f"{req.prefill_block_size} -> decode blocks of {req.decode_block_size} tokens, "
             f"head_dim {req.head_dim}, {req.dtype_nbytes}-byte elements, shuffled "
             "non-adjacent blocks", ""]
    if len(layouts) == 1:
        counts = descriptor_counts(plan, layouts[0], req)
        rows = [(rank.key, str(len(plan.reads[rank])), str(n), _size(b), _size(b / max(n, 1)))
                for rank, (n, b) in counts.items()]
        total_n = sum(n for n, _ in counts.values())
        total_b = sum(b for _, b in counts.values())
        rows.append(("total", str(plan.num_reads), str(total_n), _size(total_b),
                     _size(total_b / max(total_n, 1))))
        return "\n".join(lines + _columns(
            ("decode tp/pp", "reads", "descriptors", "bytes", "mean descriptor"), rows))
    rows = []
    for kv_layout in layouts:
        counts = descriptor_counts(plan, kv_layout, req)
        per = sorted({n for n, _ in counts.values()})
        total_n = sum(n for n, _ in counts.values())
        total_b = sum(b for _, b in counts.values())
        rows.append((kv_layout, " / ".join(str(n) for n in per), str(total_n),
                     _size(total_b / max(total_n, 1))))
    return "\n".join(lines + _columns(
        ("layout", "per decode rank", "total", "mean descriptor"), rows))


def descriptors_json(plan: TransferPlan, layouts: tuple[str, ...], req: RequestShape
                     ) -> list[dict]:
    return [{"layout": kv_layout, "tokens": req.tokens,
             "block_size": {"prefill": req.prefill_block_size, "decode": req.decode_block_size},
             "head_dim": req.head_dim, "dtype_nbytes": req.dtype_nbytes,
             "decode_ranks": {rank.key: {"descriptors": n, "nbytes": b}
                              for rank, (n, b) in counts.items()},
             "total": sum(n for n, _ in counts.values())}
            for kv_layout in layouts
            for counts in (descriptor_counts(plan, kv_layout, req),)]


def parse_layouts(text: str | None) -> tuple[str, ...]:
    """"all" -> every layout, "LBHNC,BHLNC" -> those two; checked by descriptor_counts."""
    if text is None or text.strip() == "":
        return ()
    if text.strip() == "all":
        return ALL_KV_LAYOUTS
    return tuple(part.strip() for part in text.split(","))


def render_plan_cli(kv_heads: int, layers: int, prefill_tp: int, decode_tp: int,
                    prefill_pp: int, decode_pp: int, prefill_layers: str | None,
                    decode_layers: str | None, mla: bool, as_json: bool,
                    layout: str | None = None, tokens: int = 8192, block_size: int = 16,
                    decode_block_size: int | None = None, head_dim: int = 128,
                    dtype_bytes: int = 2) -> str:
    """Everything `kvd plan` prints; raises PlanError for configs no engine can run.

    With a layout (a name, several comma-separated, or "all"), also what one request of
    `tokens` costs in NIXL descriptors per decode rank (LayoutError for shapes no pool has).
    """
    model = ModelGeometry(num_kv_heads=kv_heads, num_layers=layers, mla=mla)
    prefill = Parallelism(prefill_tp, prefill_pp, parse_partition(prefill_layers, "prefill"))
    decode = Parallelism(decode_tp, decode_pp, parse_partition(decode_layers, "decode"))
    plan = plan_transfer(model, prefill, decode)
    layouts = parse_layouts(layout)
    req = RequestShape(tokens, block_size, decode_block_size or block_size, head_dim, dtype_bytes)
    if as_json:
        out = plan.to_json()
        if layouts:
            out["descriptors"] = descriptors_json(plan, layouts, req)
        return json.dumps(out)
    if layouts:
        return render_table(plan) + "\n\n" + render_descriptors(plan, layouts, req)
    return render_table(plan)
