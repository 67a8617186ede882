"""Scheduler side: publish finished prefills, queue pulls, tell the workers.

Runs in vLLM's engine-core process, inside its single-threaded step: nothing here
waits on the daemon (a slow, frozen or dead kvd must not stall the engine's plain
requests). Publishes and pulls are sent without waiting (``NoWaitClient``); their
replies are taken in a later step, and a refusal reaches vLLM then, through the
workers' normal finished/failed reports. The publish receipt is built here, from a
hold id the engine picks and the daemon incarnation the workers registered with, so
``request_finished`` returns the prefill's kv_transfer_params at once. The bytes
move between the daemons; completions come back through the rank-0 worker, which
is where vLLM expects them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd.client import Messages, NoWaitClient, engine_hold_id
from kvd.errors import KvdError, NotFoundError
from kvd.integrations.connector_core.hybrid import one_token_short, publish_groups, pull_groups
from kvd.integrations.connector_core.messages import Handshake, StepAnnouncements
from kvd.integrations.connector_core.params import (
    ParamsError,
    ProgressivePrefill,
    RemotePrefill,
    blocks_to_pull,
    parse_progressive_prefill,
    parse_remote_prefill,
    traceparent_of,
    wants_progressive_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)
from kvd.integrations.connector_core.sealing import FINISHED_OK, Sealer
from kvd.integrations.connector_core.settings import ConnectorSettings
from kvd.integrations.connector_core.steplog import step_log
from kvd.integrations.connector_core.waiting import PullsOut
from kvd.ops.trace import TRACE
from kvd.wire import protocol as P

log = logging.getLogger("kvd.vllm")

# How long past its lease the worker waits for a publish's done_sending before it
# frees the blocks anyway (the daemon that held them must have died).
SEND_GRACE_S = 30.0
# Replies not come by then are forgotten (the workers' own deadlines cover the outcome).
FORGET_REPLY_S = 600.0
OTEL_ENV = "KVD_OTEL_TRACES"  # true: spans of the wait for the KV and the first step


def connector_spans() -> Any:
    """kvd.ops.otel.RequestSpans when KVD_OTEL_TRACES is true (the daemons' setting, read
    the same way; OTEL_EXPORTER_OTLP_* configure the export), else None: nothing of
    OpenTelemetry is imported."""
    if os.environ.get(OTEL_ENV, "").lower() not in ("1", "true", "yes", "on"):
        return None
    try:
        from kvd.ops.otel import RequestSpans
    except ImportError as exc:
        log.warning("%s is set but OpenTelemetry is missing (%s): pip install 'kvd[otel]'; "
                    "no connector spans", OTEL_ENV, exc)
        return None
    return RequestSpans(service="kvd-connector")


@dataclass(frozen=True)
class _Pull:
    remote: RemotePrefill | ProgressivePrefill
    local_block_ids: list[int]
    num_tokens: int
    quiet: bool  # notify only: vLLM does not wait for it
    local_groups: list[list[int]] | None = None  # hybrid: one list per KV-cache group


MAX_PROGRESSIVE_KEPT = 4096  # decode requests whose progressive pull may still be running


@dataclass(frozen=True)
class _Sent:
    """What a request in flight to the daemon was, to act on its reply."""

    kind: str  # "pull" or "publish"
    request_id: str
    quiet: bool = False
    local_block_ids: tuple[int, ...] = ()


class KvdScheduler:
    def __init__(self, settings: ConnectorSettings, block_size_tokens: int,
                 default_lease_s: float = 30.0,
                 groups: list[tuple[str, int]] | None = None,
                 now: Callable[[], float] = time.monotonic,
                 async_scheduling: bool = False) -> None:
        self.settings = settings
        step_log.start()  # the thread that writes the step's log lines, started here
        self.block_size_tokens = block_size_tokens
        # Hybrid models: (kvd layer kind, block size in tokens) of each KV-cache group, in
        # vLLM's order; None for one attention group (attention-only models, unchanged).
        self.groups = (groups if groups is not None
                       and (len(groups) > 1 or groups[0][0] != "attention") else None)
        self.lease_s = settings.lease_s if settings.lease_s is not None else default_lease_s
        self.peer_address: str | None = None
        self.daemon_instance = ""  # the incarnation the workers registered with
        self._now = now
        self._client: NoWaitClient | None = None
        self._pending: dict[str, _Pull] = {}
        self._meta = StepAnnouncements()
        # Tracing (KVD_OTEL_TRACES): requests waiting for their KV, and those whose KV
        # landed, until the end of their first step: (since, traceparent, attributes).
        self._spans = connector_spans()
        self._waiting: dict[str, tuple[int, str, dict[str, Any]]] = {}
        self._landed: dict[str, tuple[int, str, dict[str, Any]]] = {}
        # Progressive prefills: sealed after each chunk (sealing.py).
        self.sealing = Sealer(settings.engine_id, block_size_tokens, self.lease_s,
                              settings.consumers, lambda: self.peer_address is not None,
                              self._send_seal, async_scheduling=async_scheduling,
                              groups=self.groups)
        # build_meta calls so far: the step a request was scheduled in (trace points)
        self._steps = 0
        self._progressive_pulls: OrderedDict[str, None] = OrderedDict()
        self.pulls_out = PullsOut()  # an empty step waiting only for progressive pulls?

    @property
    def client(self) -> NoWaitClient:
        if self._client is None:
            self._client = NoWaitClient(self.settings.address, token=self.settings.token)
        return self._client

    def set_handshake(self, metadata: dict[Any, Any]) -> None:
        # Made now, at start-up, with its direct door open: a ZMQ context (and its I/O
        # thread) made in the first publish's step would cost that step ~1 ms, and a
        # door opened by the first pull adds the connect and the daemon's accept to the
        # pair's first hand-over.
        self.client.open_door(self._now())
        for meta in metadata.values():
            if isinstance(meta, Handshake) and meta.peer_address:
                self.peer_address = meta.peer_address
                self.daemon_instance = meta.instance_id
                return

    def daemon_moved(self, peer_address: str, instance_id: str) -> None:
        """The workers registered again with a restarted daemon (their pools adopted):
        receipts name the new instance from now on."""
        if peer_address:
            self.peer_address = peer_address
        if instance_id and instance_id != self.daemon_instance:
            step_log.warning("kvd restarted: the workers registered again with instance %s; "
                             "P/D resumes through it", instance_id)
            self.daemon_instance = instance_id

    # ------------------------------------------------------------ prefill side (new)

    def on_new_request(self, request: Any) -> None:
        """Mamba and sliding-window models: the prefill engine stops one prompt token short.

        A Mamba state is the state after the last token computed; the decode
        engine always recomputes the last prompt token, so it must load the state
        after N-1 tokens, not N (vLLM's NIXL connector does the same: "backoff").
        Sliding windows need it too: when a load covers the whole prompt, vLLM's
        SlidingWindowManager drops blocks for a window ending at token N, then
        rewinds to recompute token N-1, whose window reaches one token further back
        (into a block it already made null: measured on vLLM 0.32,
        tests/integrations/vllm/test_scheduler_swa.py). The prefill request is truncated to N-1
        tokens; its kv_transfer_params then say N-1, and the decode side loads that
        many and computes the rest, so every window is counted from the token the
        decode computes first.
        """
        params = request.kv_transfer_params
        if (not one_token_short(self.groups) or not wants_remote_decode(params)
                or params.get("_kvd_truncated")
                or request.num_prompt_tokens <= 1 or request.prompt_token_ids is None):
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvd_truncated"] = True

    def _progressive_tokens(self, request: Any) -> int:
        """The prompt tokens a progressive pull loads: what the prefill engine (the same
        model) computes, one token short for Mamba and sliding-window models."""
        n = request.num_prompt_tokens
        return n - 1 if one_token_short(self.groups) and n > 1 else n

    # ------------------------------------------------------------ decode side

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                               ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not wants_remote_prefill(params):
            return 0, False
        if wants_progressive_prefill(params):
            try:
                parse_progressive_prefill(params)
            except ParamsError as exc:
                step_log.warning("request %s: ignoring kv_transfer_params (%s); computing the "
                                 "prompt locally", request.request_id, exc)
                return 0, False
            count = self._progressive_tokens(request) - num_computed_tokens
            return (count, True) if count > 0 else (0, False)
        try:
            remote = parse_remote_prefill(params)
        except ParamsError as exc:
            step_log.warning("request %s: ignoring kv_transfer_params (%s); computing the prompt "
                             "locally", request.request_id, exc)
            return 0, False
        count = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        remote_bs = remote.block_size_tokens
        if (count > 0 and remote_bs and remote_bs > self.block_size_tokens
                and num_computed_tokens % remote_bs):
            # kvd reads whole prefill blocks into groups of decode blocks: a local hit
            # ending inside a prefill block cannot be continued by a pull (the daemon
            # refuses it, and vLLM's "fail" policy would then fail the request). vLLM
            # cannot shrink its local hit, so compute the tail here; after_alloc sends
            # a notify-only pull that releases the prefill engine's blocks.
            step_log.info("request %s: local prefix hit of %d tokens ends inside a prefill "
                          "block of %d tokens; computing the remaining %d tokens locally",
                          request.request_id, num_computed_tokens, remote_bs, count)
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        self.sealing.begin(request)
        if not wants_remote_prefill(params):
            return
        params["do_remote_prefill"] = False  # one pull per request, whatever happens
        if params.get("kvd_progressive"):
            self._progressive_after_alloc(request, blocks, num_external_tokens)
            return
        try:
            remote = parse_remote_prefill(params)
        except ParamsError:
            return  # warned in num_new_matched_tokens
        # The decode's own trace context (vLLM's header, with its tracing on) first.
        traceparent = traceparent_of(params, getattr(request, "trace_headers", None))
        if traceparent != remote.traceparent:
            remote = dataclasses.replace(remote, traceparent=traceparent)
        num_tokens = min(remote.num_tokens, request.num_prompt_tokens)
        TRACE.point("decode_scheduled", request.request_id, self._steps)
        if self._spans is not None and num_external_tokens > 0:
            self._waiting[request.request_id] = (time.time_ns(), traceparent, {
                "kvd.request_id": request.request_id, "kvd.engine_id": self.settings.engine_id,
                "kvd.remote_engine_id": remote.engine_id, "kvd.peer": remote.address,
                "kvd.tokens": num_external_tokens})
        if num_external_tokens <= 0:
            # Full local prefix hit: nothing to read, but P must release its blocks now.
            self._pending[request.request_id] = _Pull(remote, [], num_tokens, quiet=True)
            return
        hit_tokens = num_tokens - num_external_tokens
        if self.groups is not None:
            self._pending[request.request_id] = self._group_pull(remote, blocks, num_tokens,
                                                                 hit_tokens)
            return
        new_ids = [b.block_id for b in blocks.blocks[0] if b.block_hash is None]
        local = blocks_to_pull(num_tokens, hit_tokens, self.block_size_tokens, new_ids)
        self._pending[request.request_id] = _Pull(remote, local, num_tokens, quiet=False)

    def _progressive_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        """The decode admitted the request: its pull goes now, before the prefill has
        sealed anything; the daemon reads each range as it is sealed."""
        try:
            remote = parse_progressive_prefill(request.kv_transfer_params)
        except ParamsError:
            return  # warned in num_new_matched_tokens
        num_tokens = self._progressive_tokens(request)
        TRACE.point("decode_scheduled", request.request_id, self._steps)
        if num_external_tokens <= 0:
            self._pending[request.request_id] = _Pull(remote, [], num_tokens, quiet=True)
            return
        if self.groups is not None:  # every group read once the prefill is complete
            self._pending[request.request_id] = self._group_pull(
                remote, blocks, num_tokens, num_tokens - num_external_tokens)
            return
        new_ids = [b.block_id for b in blocks.blocks[0] if b.block_hash is None]
        local = blocks_to_pull(num_tokens, num_tokens - num_external_tokens,
                               self.block_size_tokens, new_ids)
        self._pending[request.request_id] = _Pull(remote, local, num_tokens, quiet=False)

    def _group_pull(self, remote: RemotePrefill | ProgressivePrefill, blocks: Any,
                    num_tokens: int, hit_tokens: int) -> _Pull:
        """A hybrid model's pull: the decode's blocks of each group (pull_groups)."""
        assert self.groups is not None
        kinds, sizes = zip(*self.groups, strict=True)
        groups = pull_groups(kinds, blocks.get_unhashed_block_ids_all_groups(), num_tokens,
                             hit_tokens, sizes)
        return _Pull(remote, [b for g in groups for b in g], num_tokens, quiet=False,
                     local_groups=groups)

    # ------------------------------------------------------------ prefill side

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid (HMA) hook: one block list per group; one group is as before."""
        if self.groups is None:
            return self.request_finished(request, list(block_ids[0]) if block_ids else [])
        return self.request_finished(request, [], group_block_ids=block_ids)

    def request_finished(self, request: Any, block_ids: list[int],
                         group_block_ids: tuple[list[int], ...] | None = None
                         ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        self.pulls_out.ended((request.request_id,))
        self._waiting.pop(request.request_id, None)  # aborted while its KV was coming
        if request.request_id in self.sealing:
            transfer_id = self.sealing.finish(request, block_ids, group_block_ids)
            if transfer_id is None:
                return False, None
            self._meta.sent[request.request_id] = self.lease_s + SEND_GRACE_S
            self._meta.aliases[transfer_id] = request.request_id
            return True, {"kvd_progressive": True, "kvd_transfer_id": transfer_id}
        if request.request_id in self._progressive_pulls:
            del self._progressive_pulls[request.request_id]
            if request.status.name not in FINISHED_OK:  # aborted while its pull may wait
                self.client.send(P.CancelPull(engine_id=self.settings.engine_id,
                                              request_id=request.request_id),
                                 _Sent("cancel", request.request_id), self._now())
        if wants_remote_prefill(params):
            # A decode request aborted before it was scheduled: release P's blocks.
            params["do_remote_prefill"] = False
            try:
                remote: RemotePrefill | ProgressivePrefill = (
                    parse_progressive_prefill(params) if params.get("kvd_progressive")
                    else parse_remote_prefill(params))
            except ParamsError:
                return False, None
            self._pending[request.request_id] = _Pull(remote, [], 0, quiet=True)
            return False, None
        if not wants_remote_decode(params) or request.status.name not in FINISHED_OK:
            return False, None
        num_tokens = min(request.num_computed_tokens, request.num_tokens)
        groups = None
        if self.groups is not None and group_block_ids is not None:
            kinds, sizes = zip(*self.groups, strict=True)
            groups = publish_groups(kinds, group_block_ids, num_tokens, sizes)
            blocks = [b for g in groups for b in g]
        else:
            blocks = list(block_ids[:-(-num_tokens // self.block_size_tokens)])
        if not blocks:
            return False, None
        if self.peer_address is None:
            step_log.error("request %s: no kvd peer address from the workers; not publishing",
                           request.request_id)
            return False, None
        consumers = int(params.get("kvd_consumers", self.settings.consumers))
        hold_id = engine_hold_id()
        traceparent = traceparent_of(params, getattr(request, "trace_headers", None))
        msg = Messages.publish(self.settings.engine_id, request.request_id,
                               blocks if groups is None else groups, lease_s=self.lease_s,
                               consumers=consumers, hold_id=hold_id,
                               traceparent=traceparent)
        if not self.client.send(msg, _Sent("publish", request.request_id), self._now()):
            step_log.error("request %s: kvd is not taking messages (frozen or gone); not "
                           "publishing, the decode side will compute the prompt itself",
                           request.request_id)
            return False, None
        # The receipt needs no reply: the hold id is ours, the incarnation the workers'.
        TRACE.point("publish_sent", request.request_id)
        receipt = (P.receipt(self.daemon_instance, hold_id) if self.daemon_instance
                   else "")
        self._meta.sent[request.request_id] = self.lease_s + SEND_GRACE_S
        remote = RemotePrefill(engine_id=self.settings.engine_id,
                               request_id=request.request_id, address=self.peer_address,
                               block_ids=tuple(blocks), num_tokens=num_tokens,
                               block_size_tokens=self.block_size_tokens,
                               group_block_ids=(None if groups is None
                                                else tuple(tuple(g) for g in groups)),
                               receipt=receipt, traceparent=traceparent)
        return True, remote.to_params()

    # ------------------------------------------------------------ every step

    def on_output(self, finished_recving: Any, failed_recving: Any = ()) -> None:
        """vLLM's connector output of a step: its receives are no longer out; with tracing
        on, a KV that landed ends its ``kvd.wait_kv`` span; the step after ends
        ``kvd.first_step`` (the request's first step on its KV)."""
        self.pulls_out.ended(finished_recving or ())
        if self._spans is None:
            return
        now = time.time_ns()
        for since, traceparent, attrs in self._landed.values():
            self._spans.record("kvd.first_step", traceparent, since, now, attrs)
        self._landed = {}
        failed = set(failed_recving or ())
        for rid in finished_recving or ():
            waited = self._waiting.pop(rid, None)
            if waited is None:
                continue
            since, traceparent, attrs = waited
            error = "KV load failed: vLLM recomputes the prompt" if rid in failed else ""
            self._spans.record("kvd.wait_kv", traceparent, since, now, attrs, error)
            if not error:
                self._landed[rid] = (now, traceparent, attrs)

    def build_meta(self, idle: bool = False, output: Any = None) -> StepAnnouncements:
        """Once per step: act on the replies that came, send the pulls queued since.
        ``idle``: the step computes no token (the workers may wait in it; longer if
        every pull out is progressive). ``output``: vLLM's scheduler output, whose
        blocks and computed tokens the seals follow."""
        self._take_replies()
        # one write for the step's seals and pulls: the daemon reads them as one burst
        with self.client.batch() if self._pending or self.sealing else contextlib.nullcontext():
            if output is not None and self.sealing:
                self.sealing.track(output)
            for request_id, pull in self._pending.items():
                self._start(request_id, pull)
        self._pending.clear()
        meta, self._meta = self._meta, StepAnnouncements()
        self._steps += 1
        meta.idle = idle
        meta.only_progressive = idle and self.pulls_out.only_progressive
        return meta

    def _send_seal(self, msg: P.Seal, request_id: str) -> bool:
        return self.client.send(msg, _Sent("seal", request_id), self._now())

    def _take_replies(self) -> None:
        if self._client is None:
            return
        for reply in self._client.replies():
            sent: _Sent = reply.tag
            if not isinstance(reply.body, P.Error):
                continue
            exc = Messages.refusal(reply.body)
            if isinstance(exc, NotFoundError) and "not registered" in str(exc):
                self._meta.rejoin = True  # the daemon restarted: workers register again
            if sent.kind in ("seal", "cancel"):
                step_log.warning("request %s: kvd refused the %s (%s)", sent.request_id,
                                 sent.kind, exc)
                continue
            if sent.kind == "publish":
                step_log.error("request %s: kvd refused the publish (%s); its blocks are freed "
                               "and the decode side computes the prompt itself",
                               sent.request_id, exc)
                self._meta.send_refused.append(sent.request_id)
            else:
                step_log.warning("request %s: kvd refused the pull (%s)", sent.request_id, exc)
                if not sent.quiet:
                    self._meta.refused[sent.request_id] = list(sent.local_block_ids)
        self._client.forget_older(self._now(), FORGET_REPLY_S)

    def _start(self, request_id: str, pull: _Pull) -> None:
        if isinstance(pull.remote, ProgressivePrefill):
            self._start_progressive(request_id, pull, pull.remote)
            return
        remote_groups = pull.remote.group_block_ids
        if remote_groups is None and self.groups is not None and len(self.groups) == 1:
            remote_groups = (pull.remote.block_ids,)  # one Mamba group's list comes flat
        hybrid = self.groups is not None and remote_groups is not None
        if hybrid:
            local_groups = pull.local_groups or [[] for _ in remote_groups]
            remote_ids: Any = [list(g) for g in remote_groups]
            local_ids: Any = local_groups
        else:
            remote_ids, local_ids = list(pull.remote.block_ids), pull.local_block_ids
        try:
            msg = Messages.pull(self.settings.engine_id, request_id,
                                remote_engine_id=pull.remote.engine_id,
                                remote_address=pull.remote.address,
                                remote_block_ids=remote_ids, local_block_ids=local_ids,
                                remote_request_id=pull.remote.request_id,
                                publish_receipt=pull.remote.receipt,
                                traceparent=pull.remote.traceparent,
                                num_tokens=(pull.num_tokens if pull.local_block_ids or hybrid
                                            else -1))
        except (KvdError, ValueError) as exc:  # msgspec bounds (ValidationError)
            step_log.warning("request %s: cannot build the pull (%s)", request_id, exc)
            sent_ok = False
        else:
            sent_ok = self.client.send(msg, _Sent("pull", request_id, pull.quiet,
                                                  tuple(pull.local_block_ids)), self._now())
            if not sent_ok:
                step_log.warning("request %s: kvd is not taking messages (frozen or gone); the "
                                 "pull fails now", request_id)
        self._note_sent(request_id, pull, sent_ok)

    def _note_sent(self, request_id: str, pull: _Pull, sent_ok: bool) -> bool:
        """Put a pull's send into this step's announcements; True if the workers now
        wait for its event (sent, and not quiet)."""
        if not sent_ok:
            if not pull.quiet:
                self._meta.failed[request_id] = pull.local_block_ids
            return False
        TRACE.point("pull_sent", request_id)
        if pull.quiet:
            self._meta.quiet.append(request_id)
            return False
        self._meta.recv[request_id] = pull.local_block_ids
        self.pulls_out.sent(request_id, isinstance(pull.remote, ProgressivePrefill))
        return True

    def _start_progressive(self, request_id: str, pull: _Pull,
                           remote: ProgressivePrefill) -> None:
        try:
            msg = Messages.progressive_pull(self.settings.engine_id, request_id,
                                            remote.engine_id, remote.address,
                                            (pull.local_block_ids if pull.local_groups is None
                                             else pull.local_groups), pull.num_tokens,
                                            remote_request_id=remote.request_id)
        except (KvdError, ValueError) as exc:
            step_log.warning("request %s: cannot build the pull (%s)", request_id, exc)
            sent_ok = False
        else:
            sent_ok = self.client.send(msg, _Sent("pull", request_id, pull.quiet,
                                                  tuple(pull.local_block_ids)), self._now())
        if not self._note_sent(request_id, pull, sent_ok):
            return
        self._progressive_pulls[request_id] = None
        while len(self._progressive_pulls) > MAX_PROGRESSIVE_KEPT:
            self._progressive_pulls.popitem(last=False)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._spans is not None:
            self._spans.shutdown()
            self._spans = None
