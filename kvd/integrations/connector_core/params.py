"""The kv_transfer_params kvd puts on a prefill response, and reads on a decode request.

Routers (vLLM's toy proxy, llm-d, Dynamo) copy the prefill response's
``kv_transfer_params`` into the decode request as JSON, untouched, so the
dict must survive a JSON round trip and carry everything the decode side
needs: which engine and daemon hold the blocks, under which request id, and
how many prompt tokens they cover. TP sizes are deliberately absent: both
daemons know both engines' registrations and plan from those.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvd.ops.tracecontext import parse_traceparent
from kvd.wire.protocol import MAX_RECEIPT_CHARS

# Bumped if the meaning of a key changes; decoders refuse other formats.
PARAMS_FORMAT = 1
MAX_BLOCKS = 1 << 20  # a 16M-token prompt at 16 tokens a block: far past any engine
MAX_ID_CHARS = 256



class ParamsError(ValueError):
    """kv_transfer_params that cannot have come from a kvd prefill engine."""


@dataclass(frozen=True)
class RemotePrefill:
    """Where the decode side finds a finished prefill."""

    engine_id: str  # the prefill engine's kvd engine id
    request_id: str  # the prefill engine's request id (vLLM's P and D ids differ)
    address: str  # peer address of a daemon hosting the prefill engine
    block_ids: tuple[int, ...]  # the prefill's blocks, in token order
    num_tokens: int  # prompt tokens whose KV those blocks hold
    # Tokens per prefill block (None: not sent, older prefill engines). The decode side
    # needs it to tell whether its local prefix hit ends on a prefill block boundary.
    block_size_tokens: int | None = None
    # Hybrid models (several KV-cache groups): one block-id list per group, in vLLM's
    # group order (block_ids is then their concatenation). None: one group.
    group_block_ids: tuple[tuple[int, ...], ...] | None = None
    # The prefill daemon's publish receipt ("": none, older prefill engines): the decode
    # daemon then needs no proof from the hold's age that it reads after the publish.
    receipt: str = ""
    # The request's W3C trace context ("": none), which the pull's spans join.
    traceparent: str = ""

    def to_params(self) -> dict[str, Any]:
        """The dict a prefill engine returns; vLLM's standard keys plus ours."""
        extra: dict[str, Any] = ({} if self.block_size_tokens is None
                                 else {"kvd_block_size": self.block_size_tokens})
        if self.receipt:
            extra["kvd_receipt"] = self.receipt
        if self.traceparent:
            extra["traceparent"] = self.traceparent
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": (list(self.block_ids) if self.group_block_ids is None
                                 else [list(g) for g in self.group_block_ids]),
            "remote_num_tokens": self.num_tokens,
            "kvd_address": self.address,
            "kvd_format": PARAMS_FORMAT,
            **extra,
        }


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request the router will hand to a decode engine."""
    return bool(params) and bool(params.get("do_remote_decode"))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """A decode request whose prompt KV waits on a prefill engine."""
    return bool(params) and bool(params.get("do_remote_prefill"))


def traceparent_of(params: Mapping[str, Any] | None,
                   headers: Mapping[str, str] | None = None) -> str:
    """The request's W3C trace context: vLLM's own trace headers (taken from the HTTP
    request when its tracing is on), else ``kv_transfer_params["traceparent"]`` (set by
    ``kvd router``); "" when neither holds a valid one (never an error: tracing is
    best effort and never fails a request)."""
    for source in (headers, params):
        value = source.get("traceparent") if source else None
        if isinstance(value, str) and parse_traceparent(value) is not None:
            return value
    return ""


def _str(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise ParamsError(f"kv_transfer_params[{key!r}] must be a string of 1..{MAX_ID_CHARS} "
                          f"characters, got {value!r:.80}")
    return value


def _int(value: Any, what: str) -> int:
    # bool is an int in Python; a JSON true is not a block id.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParamsError(f"{what} must be a non-negative integer, got {value!r:.80}")
    return value


def parse_remote_prefill(params: Mapping[str, Any]) -> RemotePrefill:
    """Validate a decode request's params; every failure names the key."""
    fmt = params.get("kvd_format")
    if fmt != PARAMS_FORMAT:
        raise ParamsError(f"kv_transfer_params come from another connector or kvd version "
                          f"(kvd_format={fmt!r}, expected {PARAMS_FORMAT})")
    blocks = params.get("remote_block_ids")
    groups = None
    if isinstance(blocks, (list, tuple)) and len(blocks) == 1 and isinstance(blocks[0], list):
        blocks = blocks[0]  # one KV-cache group, in vLLM's per-group form
    elif (isinstance(blocks, (list, tuple)) and blocks
          and all(isinstance(g, (list, tuple)) for g in blocks)):
        # several KV-cache groups (hybrid model): one list each
        if sum(len(g) for g in blocks) > MAX_BLOCKS:
            raise ParamsError(f"kv_transfer_params['remote_block_ids'] must name at most "
                              f"{MAX_BLOCKS} block ids")
        groups = tuple(tuple(_int(b, "remote block id") for b in g) for g in blocks)
        blocks = [b for g in groups for b in g]
    if not isinstance(blocks, (list, tuple)) or len(blocks) > MAX_BLOCKS:
        raise ParamsError(f"kv_transfer_params['remote_block_ids'] must be a list of at most "
                          f"{MAX_BLOCKS} block ids")
    block_ids = tuple(_int(b, "remote block id") for b in blocks)
    num_tokens = _int(params.get("remote_num_tokens"), "kv_transfer_params['remote_num_tokens']")
    block_size = params.get("kvd_block_size")  # absent from older prefill engines
    if block_size is not None and not _int(block_size, "kv_transfer_params['kvd_block_size']"):
        raise ParamsError("kv_transfer_params['kvd_block_size'] must be positive")
    receipt = params.get("kvd_receipt", "")  # absent from older prefill engines
    if not isinstance(receipt, str) or len(receipt) > MAX_RECEIPT_CHARS:
        raise ParamsError(f"kv_transfer_params['kvd_receipt'] must be a string of at most "
                          f"{MAX_RECEIPT_CHARS} characters, got {receipt!r:.80}")
    return RemotePrefill(engine_id=_str(params, "remote_engine_id"),
                         request_id=_str(params, "remote_request_id"),
                         address=_str(params, "kvd_address"),
                         block_ids=block_ids, num_tokens=num_tokens,
                         block_size_tokens=block_size, group_block_ids=groups,
                         receipt=receipt, traceparent=traceparent_of(params))


def blocks_to_pull(num_prompt_tokens: int, num_computed_tokens: int, block_size_tokens: int,
                   new_block_ids: list[int]) -> list[int]:
    """The decode blocks that receive the remote tail [num_computed_tokens, num_prompt_tokens).

    The scheduler may allocate more blocks than the prompt needs (room for the
    first decoded token); only those holding prompt tokens are written.
    """
    if num_computed_tokens % block_size_tokens:
        raise ParamsError(f"local prefix hit of {num_computed_tokens} tokens is not a multiple "
                          f"of the block size {block_size_tokens}")
    total = -(-num_prompt_tokens // block_size_tokens)
    need = total - num_computed_tokens // block_size_tokens
    if need > len(new_block_ids):
        raise ParamsError(f"{len(new_block_ids)} new blocks cannot hold the {need} blocks of "
                          f"tokens [{num_computed_tokens}, {num_prompt_tokens})")
    return list(new_block_ids[:max(need, 0)])


# ------------------------------------------------------------------ progressive pulls
# The router sends a request to the prefill and the decode engine at once. The prefill's
# params carry ``kvd_transfer_id`` (the id its connector seals the request under); the
# decode's name the prefill engine, its daemon and that id, and no block ids: the decode's
# daemon reads each range as the prefill's daemon seals it.


def progressive_transfer_id(params: Mapping[str, Any] | None) -> str | None:
    """A prefill request to seal progressively: its transfer id, else None."""
    if not wants_remote_decode(params) or not params.get("kvd_progressive"):  # type: ignore[union-attr]
        return None
    return _str(params, "kvd_transfer_id")  # type: ignore[arg-type]


def wants_progressive_prefill(params: Mapping[str, Any] | None) -> bool:
    """A decode request whose prompt KV a prefill engine computes meanwhile."""
    return wants_remote_prefill(params) and bool(params.get("kvd_progressive"))  # type: ignore[union-attr]


@dataclass(frozen=True)
class ProgressivePrefill:
    """Where the decode side finds a prefill still running (no block ids yet)."""

    engine_id: str
    request_id: str  # the router's transfer id, which the prefill seals under
    address: str

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "kvd_progressive": True,
                "remote_engine_id": self.engine_id, "remote_request_id": self.request_id,
                "kvd_address": self.address, "kvd_format": PARAMS_FORMAT}


def parse_progressive_prefill(params: Mapping[str, Any]) -> ProgressivePrefill:
    fmt = params.get("kvd_format")
    if fmt != PARAMS_FORMAT:
        raise ParamsError(f"kv_transfer_params come from another connector or kvd version "
                          f"(kvd_format={fmt!r}, expected {PARAMS_FORMAT})")
    return ProgressivePrefill(engine_id=_str(params, "remote_engine_id"),
                              request_id=_str(params, "remote_request_id"),
                              address=_str(params, "kvd_address"))
