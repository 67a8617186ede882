"""`kvd plan` output: a table for people, the issue's JSON shape for scripts."""

from __future__ import annotations

import json

from kvd.errors import PlanError
from kvd.planner.plan import TransferPlan, plan_transfer
from kvd.planner.topology import ModelGeometry, Parallelism, partition


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


def render_plan_cli(kv_heads: int, layers: int, prefill_tp: int, decode_tp: int,
                    prefill_pp: int, decode_pp: int, prefill_layers: str | None,
                    decode_layers: str | None, mla: bool, as_json: bool) -> str:
    """Everything `kvd plan` prints; raises PlanError for configs no engine can run."""
    model = ModelGeometry(num_kv_heads=kv_heads, num_layers=layers, mla=mla)
    prefill = Parallelism(prefill_tp, prefill_pp, parse_partition(prefill_layers, "prefill"))
    decode = Parallelism(decode_tp, decode_pp, parse_partition(decode_layers, "decode"))
    plan = plan_transfer(model, prefill, decode)
    if as_json:
        return json.dumps(plan.to_json())
    return render_table(plan)
