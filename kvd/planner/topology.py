"""Who holds what: vLLM's head and layer ownership for one engine.

The planner never trusts a rank to describe its own shard; it derives every
rank's heads and layers from the model geometry and the engine's parallelism,
with exactly the rules vLLM uses, so both sides of a pair agree without
exchanging tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.errors import PlanError


@dataclass(frozen=True)
class ModelGeometry:
    """The model facts ownership depends on (head_dim and dtype only matter to layout)."""

    num_kv_heads: int  # K, total KV heads (ignored for MLA: one latent "head")
    num_layers: int  # L
    mla: bool = False


@dataclass(frozen=True)
class Parallelism:
    """How one engine is split; layer_partition=None means vLLM's default split."""

    tp_size: int
    pp_size: int = 1
    layer_partition: tuple[int, ...] | None = None  # layers per PP stage


def default_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """vLLM get_pp_indices: L // pp each, remainder one each to the stages before the last.

    The last stage carries the final norm/lm-head, so vLLM keeps it light; we
    must reproduce the exact split or decode would read the wrong layers.
    """
    partitions = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        partitions[-i] += 1
    return tuple(partitions)


# No engine runs more ranks than this per dimension; the bound keeps every per-rank loop
# (planning, rank bookkeeping) small whatever a registration or a peer claims.
MAX_PARALLEL_SIZE = 1024


def check_parallelism(model: ModelGeometry, par: Parallelism, role: str) -> None:
    """Refuse, in one line, any engine vLLM itself could not run."""
    if model.num_layers < 1:
        raise PlanError(f"model needs at least 1 layer, got {model.num_layers}")
    if not model.mla and model.num_kv_heads < 1:
        raise PlanError(f"model needs at least 1 KV head, got {model.num_kv_heads}")
    if par.tp_size < 1:
        raise PlanError(f"{role} TP size must be >= 1, got {par.tp_size}")
    if par.pp_size < 1:
        raise PlanError(f"{role} PP size must be >= 1, got {par.pp_size}")
    for name, size in (("TP", par.tp_size), ("PP", par.pp_size)):
        if size > MAX_PARALLEL_SIZE:
            raise PlanError(f"{role} {name} size {size} exceeds {MAX_PARALLEL_SIZE}")
    k, t = model.num_kv_heads, par.tp_size
    if not model.mla and k % t != 0 and t % k != 0:
        raise PlanError(
            f"{role} TP {t} cannot shard {k} KV heads: "
            f"needs {k} % {t} == 0 (sharded) or {t} % {k} == 0 (replicated)"
        )
    if par.pp_size > model.num_layers:
        raise PlanError(
            f"{role} PP {par.pp_size} exceeds the model's {model.num_layers} layers"
        )
    part = par.layer_partition
    if part is not None:
        if len(part) != par.pp_size:
            raise PlanError(
                f"{role} layer partition has {len(part)} stages but PP size is {par.pp_size}"
            )
        if any(n < 1 for n in part):
            raise PlanError(f"{role} layer partition {list(part)} has a stage with < 1 layer")
        if sum(part) != model.num_layers:
            raise PlanError(
                f"{role} layer partition {list(part)} sums to {sum(part)}, "
                f"model has {model.num_layers} layers"
            )


def partition(model: ModelGeometry, par: Parallelism) -> tuple[int, ...]:
    """Layers per PP stage, explicit or vLLM's default."""
    if par.layer_partition is not None:
        return par.layer_partition
    return default_partition(model.num_layers, par.pp_size)


def stage_layers(model: ModelGeometry, par: Parallelism, pp_rank: int) -> tuple[int, int]:
    """Global half-open layer range held by PP stage pp_rank."""
    part = partition(model, par)
    start = sum(part[:pp_rank])
    return (start, start + part[pp_rank])


def heads_per_rank(model: ModelGeometry, par: Parallelism) -> int:
    """Size of a rank's head dimension: K/t when sharded, 1 when replicated or MLA."""
    if model.mla or par.tp_size >= model.num_kv_heads:
        return 1
    return model.num_kv_heads // par.tp_size


def rank_heads(model: ModelGeometry, par: Parallelism, tp_rank: int) -> tuple[int, int]:
    """Global half-open head range of a TP rank (vLLM's contiguous GQA partitioning).

    With t > K consecutive ranks share a head (rank r holds head r*K//t), which
    is how vLLM replicates the KV projection weights.
    """
    if model.mla:
        return (0, 1)
    k, t = model.num_kv_heads, par.tp_size
    if t <= k:
        return (tp_rank * k // t, (tp_rank + 1) * k // t)
    head = tp_rank * k // t
    return (head, head + 1)


def head_holders(model: ModelGeometry, par: Parallelism, head: int) -> range:
    """TP ranks that hold a head: one owner when sharded, t/K replicas when replicated."""
    if model.mla:
        return range(par.tp_size)
    k, t = model.num_kv_heads, par.tp_size
    if t <= k:
        owner = head * t // k
        return range(owner, owner + 1)
    return range(head * t // k, (head + 1) * t // k)
