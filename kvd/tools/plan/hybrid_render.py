"""`kvd plan --hybrid`: a hybrid plan for people (and JSON), with descriptor counts.

Given a request size it also builds the descriptors of one request in vLLM's
hybrid pools on both sides and sets them next to what vLLM's own connector
(seed 004, the "3-read" path) would post for the same pull, so the cost of a
layout or TP choice is visible without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvd.errors import PlanError
from kvd.planner.hybrid.layout import (
    AttentionGroupLayout,
    HybridRankLayout,
    build_hybrid_descriptors,
    hybrid_head_layout,
    vllm_rank_layout,
)
from kvd.planner.hybrid.plan import (
    TOKEN_KINDS,
    HybridModel,
    HybridPlan,
    compat_hash,
    model_from_json,
    plan_hybrid,
)
from kvd.planner.plan import RankId
from kvd.planner.topology import Parallelism, partition
from kvd.tools.plan.render import parse_partition

# Nemotron-H-8B-Base-8K as vLLM's NemotronHConfig defaults describe it: 52 layers
# (24 Mamba2, 4 attention, 24 MLP), Mamba2 128 heads x 64, 8 groups, d_state 128,
# conv kernel 4; GQA 8 KV heads x 128; bf16 caches (mamba_ssm_cache_dtype "auto").
PRESETS: dict[str, dict] = {
    "nemotron-h-8b": {
        "name": "nemotron-h-8b",
        "pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "attention": {"num_kv_heads": 8, "head_dim": 128, "dtype_nbytes": 2},
        "mamba": {"num_heads": 128, "head_dim": 64, "n_groups": 8, "d_state": 128,
                  "conv_kernel": 4, "conv_dtype_nbytes": 2, "ssm_dtype_nbytes": 2},
    },
    # a small model with every kind, for trying shapes: 12 SSM heads, 2 groups, window 64
    "tiny-hybrid": {
        "name": "tiny-hybrid",
        "pattern": "M*MS-M*MS-",
        "window_tokens": 64,
        "attention": {"num_kv_heads": 4, "head_dim": 64, "dtype_nbytes": 2},
        "mamba": {"num_heads": 12, "head_dim": 32, "n_groups": 2, "d_state": 16,
                  "conv_kernel": 4, "conv_dtype_nbytes": 2, "ssm_dtype_nbytes": 4},
    },
}


def load_model(spec: str) -> HybridModel:
    """A preset name or a JSON file (HybridModel.to_json, or the short form with "pattern")."""
    if spec in PRESETS:
        return model_from_json(PRESETS[spec])
    try:
        data = json.loads(Path(spec).read_text())
    except OSError as exc:
        raise PlanError(f"cannot read hybrid model {spec!r} ({exc.strerror}); presets: "
                        f"{', '.join(PRESETS)}") from None
    except ValueError as exc:
        raise PlanError(f"hybrid model {spec!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError(f"hybrid model {spec!r} must be a JSON object")
    return model_from_json(data)


def _span(r: tuple[int, int] | None, scale: int = 1) -> str:
    return "-" if r is None else f"[{r[0] * scale},{r[1] * scale})"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(header[c]), *(len(r[c]) for r in rows)) for c in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (header, *rows)]


def describe_model(model: HybridModel) -> list[str]:
    kinds = [model.layers_of(k) for k in ("mamba", "attention", "sliding", "none")]
    lines = [f"model {model.name or '(unnamed)'} (compat {compat_hash(model)}): "
             f"{model.num_layers} layers: {len(kinds[0])} Mamba, {len(kinds[1])} attention, "
             f"{len(kinds[2])} sliding window, {len(kinds[3])} without cache"]
    if model.attention and (kinds[1] or kinds[2]):
        a = model.attention
        heads = "MLA latent" if a.mla else f"{a.num_kv_heads} KV heads"
        lines.append(f"  attention: {heads} x {a.head_dim}, {a.dtype_nbytes} B")
    if model.mamba and kinds[0]:
        s = model.mamba
        lines.append(f"  Mamba: {s.num_heads} SSM heads x {s.head_dim}, {s.n_groups} groups x "
                     f"{s.d_state} state, conv kernel {s.conv_kernel}; conv "
                     f"{s.conv_dtype_nbytes} B, SSM {s.ssm_dtype_nbytes} B")
    groups = []
    for g, group in enumerate(model.groups):
        kind = model.group_kind(g)
        if kind == "sliding":
            kind = f"sliding {model.group_window(g)}"
        groups.append(f"{g}:{kind}{list(group.layers)}".replace(" ", ""))
    lines.append(f"  {len(model.groups)} KV-cache groups: " + " ".join(groups))
    return lines


def render_reads(plan: HybridPlan) -> list[str]:
    m = plan.model
    lines = []
    for role, par in (("prefill", plan.prefill), ("decode: ", plan.decode)):
        lines.append(f"{role} TP {par.tp_size} x PP {par.pp_size} (layers per stage "
                     f"{list(partition(m.geometry, par))})")
    if any(plan.attention.values()):
        lines += ["", "attention reads (each attention and sliding-window group):"]
        rows = []
        for rank in plan.decode_ranks:
            for i, r in enumerate(plan.attention[rank]):
                rows.append((rank.key if i == 0 else "", r.remote.key, _span(r.heads),
                             _span(r.local_heads), _span(r.remote_heads), _span(r.layers)))
        lines += _table(("decode tp/pp", "<- prefill tp/pp", "heads", "local heads",
                         "remote heads", "layers"), rows)
    if any(plan.mamba.values()) and m.mamba is not None:
        p, n = m.mamba.head_dim, m.mamba.d_state
        lines += ["", "Mamba reads (per Mamba layer: x, B and C conv slices + SSM heads; "
                  "channels local <- remote):"]
        rows = []
        for rank in plan.decode_ranks:
            for i, r in enumerate(plan.mamba[rank]):
                rows.append((
                    rank.key if i == 0 else "", r.remote.key, _span(r.heads),
                    f"{_span(r.local_heads, p)} <- {_span(r.remote_heads, p)}",
                    "-" if r.groups is None else
                    f"{_span(r.local_groups, n)} <- {_span(r.remote_groups, n)}",
                    f"{_span(r.local_heads)} <- {_span(r.remote_heads)}",
                    _span(r.layers), str(r.reads_per_layer)))
        lines += _table(("decode tp/pp", "<- prefill tp/pp", "heads", "x channels",
                         "B and C channels", "SSM heads", "layers", "reads/layer"), rows)
    lines += ["", "consumers (decode ranks that read from each prefill rank):",
              "  " + "  ".join(f"{r.key}={c}" for r, c in plan.consumers.items())]
    return lines


# ------------------------------------------------------------ descriptor counts


def _ratio(layout: HybridRankLayout) -> int:
    return next((g.blocks_per_logical for g in layout.groups
                 if isinstance(g, AttentionGroupLayout)), 1)


def _request_ids(model: HybridModel, layout_tokens: int, num_tokens: int) -> list[list[int]]:
    """Block ids of one request per group; no two ids of a group adjacent (a busy pool)."""
    n_groups = len(model.groups)
    blocks = max(1, -(-num_tokens // layout_tokens))
    return [[2 * g] if model.group_kind(g) == "mamba" else
            [2 * (j * n_groups + g) for j in range(blocks)] for g in range(n_groups)]


def vllm_3read_count(plan: HybridPlan, decode_rank: RankId, local_ids: list[list[int]],
                     local_ratio: int, same_kernel_block: bool) -> tuple[int | None, str]:
    """What vLLM's NixlConnectorWorker posts for this decode rank's pull (seed 004).

    Per remote rank it reads: for every attention group, 2 regions (K, V) per
    shared tensor x every kernel block of every named logical block (expanded
    with the *local* ratio); for every Mamba group, 4 regions (x, B, C, SSM) per
    tensor x every named slot. Sources: the one rank D // (D/P) when D >= P, the
    P/D ranks [d*P/D, (d+1)*P/D) when P > D, attention only from those whose
    heads differ. Returns (None, why) where vLLM refuses the pair.
    """
    p, d = plan.prefill.tp_size, plan.decode.tp_size
    if plan.prefill.pp_size > 1 or plan.decode.pp_size > 1:
        return None, "vLLM's NIXL path is TP-only"
    if p % d and d % p:
        return None, f"vLLM needs one TP to divide the other ({p} vs {d})"
    if not same_kernel_block:
        return None, "vLLM asserts block_size_ratio == 1 under the hybrid allocator"
    m = plan.model
    tensors = max(len(g.layers) for g in m.groups)
    att = sum(len(local_ids[g]) * local_ratio for g in range(len(m.groups))
              if m.group_kind(g) in TOKEN_KINDS)
    mamba = sum(len(local_ids[g]) for g in range(len(m.groups)) if m.group_kind(g) == "mamba")
    fa_sources = len(plan.attention[decode_rank])
    sources = 1 if d >= p else max(p // d, fa_sources)
    total = fa_sources * 2 * tensors * att + sources * 4 * tensors * mamba
    return total, f"{fa_sources} x {2 * tensors * att} attention + {sources} x " \
        f"{4 * tensors * mamba} Mamba"


def descriptor_report(plan: HybridPlan, num_tokens: int, prefill_block_tokens: int,
                      decode_block_tokens: int, kv_layout: str = "LBHNC") -> dict:
    """Descriptors of one request of num_tokens per decode rank and source, in vLLM pools
    with attention pages in kv_layout (vLLM's hybrid engines: LBHNC)."""
    m = plan.model
    counts: dict[str, object] = {"tokens": num_tokens, "prefill_kernel_block_tokens":
                                 prefill_block_tokens,
                                 "decode_kernel_block_tokens": decode_block_tokens,
                                 "kv_layout": kv_layout}
    layouts = {}
    for side, par, kbs in (("prefill", plan.prefill, prefill_block_tokens),
                           ("decode", plan.decode, decode_block_tokens)):
        probe = vllm_rank_layout(m, par, 0, 1, kbs, kv_layout=kv_layout)
        ratio = _ratio(probe)
        blocks = max(1, -(-num_tokens // (kbs * ratio)))
        size = 2 * len(m.groups) * blocks + 2
        layouts[side] = ({pp: vllm_rank_layout(m, par, pp, size, kbs, kv_layout=kv_layout)
                          for pp in range(par.pp_size)}, ratio)
        counts[f"{side}_blocks_per_logical"] = ratio
    (p_lay, p_ratio), (d_lay, d_ratio) = layouts["prefill"], layouts["decode"]
    remote_ids = _request_ids(m, prefill_block_tokens * p_ratio, num_tokens)
    local_ids = _request_ids(m, decode_block_tokens * d_ratio, num_tokens)
    ranks = []
    for rank in plan.decode_ranks:
        sources = []
        for src in plan.sources(rank):
            desc = build_hybrid_descriptors(plan, rank, src, d_lay[rank.pp_rank],
                                            p_lay[src.pp_rank], local_ids, remote_ids, num_tokens)
            kinds = [m.group_kind(g) for g in range(len(m.groups))]
            sources.append({
                "remote": src.key,
                "attention": sum(len(x) for x, k in zip(desc.groups, kinds, strict=True)
                                 if k in TOKEN_KINDS),
                "mamba": sum(len(x) for x, k in zip(desc.groups, kinds, strict=True)
                             if k == "mamba"),
                "nbytes": desc.total_nbytes,
            })
        vllm, why = vllm_3read_count(plan, rank, local_ids, d_ratio,
                                     prefill_block_tokens == decode_block_tokens)
        ranks.append({"tp_rank": rank.tp_rank, "pp_rank": rank.pp_rank, "sources": sources,
                      "total": sum(s["attention"] + s["mamba"] for s in sources),
                      "vllm_3read": vllm, "vllm_3read_note": why})
    counts["decode_ranks"] = ranks
    return counts


def render_report(report: dict) -> list[str]:
    lines = ["", f"descriptors for one request of {report['tokens']} tokens in vLLM hybrid pools "
             f"(attention pages {report.get('kv_layout', 'LBHNC')}; "
             f"kernel blocks: prefill {report['prefill_kernel_block_tokens']}, decode "
             f"{report['decode_kernel_block_tokens']} tokens; kernel blocks per logical block: "
             f"prefill {report['prefill_blocks_per_logical']}, decode "
             f"{report['decode_blocks_per_logical']}; no two block ids of a group adjacent):"]
    rows = []
    for r in report["decode_ranks"]:
        key = f"{r['tp_rank']}/{r['pp_rank']}"
        for i, s in enumerate(r["sources"]):
            rows.append((key if i == 0 else "", s["remote"], str(s["attention"]),
                         str(s["mamba"]), str(s["attention"] + s["mamba"]),
                         f"{s['nbytes'] / 2**20:.1f}"))
    lines += _table(("decode tp/pp", "<- prefill tp/pp", "attention", "Mamba", "total", "MiB"),
                    rows)
    lines.append("")
    for r in report["decode_ranks"]:
        vllm = r["vllm_3read"]
        other = (f"vLLM 3-read path {vllm} ({r['vllm_3read_note']})" if vllm is not None
                 else f"vLLM: refused ({r['vllm_3read_note']})")
        lines.append(f"decode {r['tp_rank']}/{r['pp_rank']}: kvd {r['total']} descriptors; "
                     f"{other}")
    return lines


def render_hybrid_cli(model_spec: str, prefill_tp: int, decode_tp: int, prefill_pp: int,
                      decode_pp: int, prefill_layers: str | None, decode_layers: str | None,
                      tokens: int, prefill_block_tokens: int, decode_block_tokens: int | None,
                      as_json: bool, kv_layout: str | None = None) -> str:
    """Everything `kvd plan --hybrid` prints; raises KvdError for configs no engine can run.

    tokens > 0 adds the descriptor counts of one request of that many tokens,
    with kernel blocks of prefill_block_tokens (decode: decode_block_tokens, or
    the same) and attention pages in kv_layout (default LBHNC, what vLLM's hybrid
    engines use; blocks_first and LBNHC are the others a hybrid pool can have).
    """
    model = load_model(model_spec)
    prefill = Parallelism(prefill_tp, prefill_pp, parse_partition(prefill_layers, "prefill"))
    decode = Parallelism(decode_tp, decode_pp, parse_partition(decode_layers, "decode"))
    d_kbs = decode_block_tokens if decode_block_tokens is not None else prefill_block_tokens
    if min(prefill_block_tokens, d_kbs) < 1:
        raise PlanError(f"block sizes must be >= 1 token, got {prefill_block_tokens} / {d_kbs}")
    plan = plan_hybrid(model, prefill, decode)
    hybrid_head_layout(kv_layout or "LBHNC")  # refuses layouts a hybrid pool cannot have
    report = (descriptor_report(plan, tokens, prefill_block_tokens, d_kbs, kv_layout or "LBHNC")
              if tokens > 0 else None)
    if as_json:
        out = plan.to_json()
        if report is not None:
            out["descriptors"] = report
        return json.dumps(out)
    lines = [*describe_model(model), *render_reads(plan)]
    if report is not None:
        lines += render_report(report)
    return "\n".join(lines)
