"""``kvd bench vllm``'s pure parts: the systems, the arithmetic, the table, the
breakdown. The runner itself (real engines) is the vLLM suite's smoke test
(tests/integrations/vllm/test_bench_vllm_smoke.py)."""

from __future__ import annotations

import json

import pytest

from kvd.tools.bench.vllm_stats import (
    Batch,
    Counters,
    Single,
    add_ratios,
    breakdown,
    first_transfers,
    percentile,
    render,
    summarize,
    targets,
)
from kvd.tools.bench.vllm_systems import (
    QUIET_NIXL_MODULE,
    SYSTEMS,
    engine_args,
    parse_systems,
    system_spec,
)


def test_parse_systems_puts_plain_first_and_refuses_unknown_names():
    assert parse_systems("all") == tuple(n for n in SYSTEMS
                                         if n not in ("kvd-1d-spin", "kvd-1d-burst",
                                                      "kvd-1d-zmq", "kvd-1d-vllmspin",
                                                      "nixl-noprog-cap")
                                         and not n.endswith("-prog"))
    assert parse_systems("kvd-1d-spin") == ("plain", "kvd-1d-spin")
    assert parse_systems("quick") == ("plain", "kvd-1d", "nixl-noprog")
    assert parse_systems("nixl, kvd-1d,nixl") == ("plain", "nixl", "kvd-1d")
    with pytest.raises(ValueError, match="unknown systems kvd-3d"):
        parse_systems("kvd-3d")


def test_the_copy_burst_a_b_is_one_daemon_with_copy_bursts_on():
    each = system_spec("kvd-1d-burst")
    assert [d.extra_args for d in each.daemons] == [("--set", "copy_bursts=true")]
    assert {e.daemon for e in each.engines} == {each.daemons[0].name}


def test_the_direct_door_a_b_is_one_daemon_with_the_door_shut():
    """Its engines find no door and stay on ZMQ: the hand-over as before the door."""
    shut = system_spec("kvd-1d-zmq")
    assert [d.extra_args for d in shut.daemons] == [("--set", "engine_direct=false")]
    assert {e.daemon for e in shut.engines} == {shut.daemons[0].name}


def test_the_queue_spin_a_b_is_one_daemon_with_vllms_own_spin():
    each = system_spec("kvd-1d-vllmspin")
    assert [d.extra_args for d in each.daemons] == [()]
    assert {e.daemon for e in each.engines} == {each.daemons[0].name}
    assert all(e.kv_transfer_config["kv_connector_extra_config"] == {"kvd_queue_spin_s": 1}
               for e in each.engines)
    plain_kvd = system_spec("kvd-1d").engines[0].kv_transfer_config
    assert "kvd_queue_spin_s" not in plain_kvd["kv_connector_extra_config"]


def test_each_system_runs_its_connector_and_daemons():
    one = system_spec("kvd-1d")
    assert len(one.daemons) == 1
    assert {e.daemon for e in one.engines} == {one.daemons[0].name}
    two = system_spec("kvd-2d-nixl")
    assert [e.daemon for e in two.engines] == [d.name for d in two.daemons]
    assert all(d.extra_args == ("--set", "host_pulls=false") for d in two.daemons)
    assert system_spec("kvd-2d").daemons[0].extra_args == ()
    spin = system_spec("kvd-1d-spin").engines[1].kv_transfer_config
    assert spin["kv_connector_extra_config"] == {"kvd_idle_wait_s": 0}
    assert one.engines[1].kv_transfer_config["kv_connector_extra_config"] == {}
    quiet = system_spec("nixl-noprog").engines[0].kv_transfer_config
    assert quiet["kv_connector_module_path"] == QUIET_NIXL_MODULE
    assert quiet["kv_buffer_device"] == "cpu"
    assert quiet["kv_connector"] == "QuietNixlConnector"
    capped = system_spec("nixl-noprog-cap").engines[1].kv_transfer_config
    assert capped["kv_connector"] == "CappedNixlConnector"
    assert capped["kv_connector_module_path"] == QUIET_NIXL_MODULE
    shipped = system_spec("nixl").engines[0].kv_transfer_config
    assert shipped["kv_connector"] == "NixlConnector"
    assert "kv_connector_module_path" not in shipped
    assert system_spec("plain").engines[0].kv_transfer_config is None
    # the same engine but the connector: prefix caching off everywhere
    args = engine_args("/m", 8100, 1 << 27, 2048, shipped)
    assert "--no-enable-prefix-caching" in args
    assert json.loads(args[args.index("--kv-transfer-config") + 1]) == shipped
    assert "--kv-transfer-config" not in engine_args("/m", 8100, 1 << 27, 2048, None)


def test_progressive_systems_are_their_base_through_the_progressive_router():
    prog, base = system_spec("kvd-2d-nixl-prog"), system_spec("kvd-2d-nixl")
    assert prog.router_args == ("--progressive",) and base.router_args == ()
    assert [d.extra_args for d in prog.daemons] == [d.extra_args for d in base.daemons]
    assert [e.daemon for e in prog.engines] == [d.name for d in prog.daemons]
    names = {d.name for d in prog.daemons} | {e.name for e in prog.engines}
    assert not names & ({d.name for d in base.daemons} | {e.name for e in base.engines})
    assert parse_systems("progressive") == ("plain", "kvd-1d", "kvd-1d-prog", "kvd-2d-nixl",
                                            "kvd-2d-nixl-prog")
    args = engine_args("/m", 8100, 1 << 27, 9000, None, max_num_batched_tokens=512)
    assert args[args.index("--max-num-batched-tokens") + 1] == "512"
    assert "--enable-chunked-prefill" in args
    assert "--max-num-batched-tokens" not in engine_args("/m", 8100, 1 << 27, 2048, None)


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 95) == 95
    assert percentile([5.0], 95) == 5.0


def _batch(system: str, firsts: list[float], step_s: float = 0.01) -> Batch:
    return Batch(system, 0, 10.0, tuple(10.0 + f for f in firsts),
                 tuple(10.5 + f for f in firsts), (step_s,) * 5, len(firsts), len(firsts))


def test_summary_takes_the_warm_rounds_and_measures_a_batch_in_steps():
    singles = [Single("kvd-1d", 0, 0.9, 1.2, 2, 2), Single("kvd-1d", 1, 0.1, 0.4, 2, 2),
               Single("kvd-1d", 2, 0.3, 0.5, 1, 2)]
    plain = {0: 0.2, 1: 0.2, 2: 0.2}
    s = summarize("kvd-1d", singles, [_batch("kvd-1d", [0.10, 0.115, 0.105])], plain,
                  Counters(decode_requests=4, decode_computed_tokens=4.0,
                           decode_loaded_tokens=3196.0, bytes_moved=4000.0,
                           idle_cores_per_engine=0.01))
    assert s.first_handover_ms == 900.0  # round 0, reported apart
    assert s.handover_p50_ms == 200.0  # median of 100 and 300 ms
    assert s.ttft_minus_plain_p50_ms == 250.0
    assert s.batch_spread_p50_ms == 15.0
    assert s.batch_spread_steps_max == 1.5
    assert s.tokens_equal == "8/9"  # 5 of 6 single streams, 3 of 3 in the batch
    assert s.decode_computed_tokens_per_request == 1.0
    assert s.bytes_per_request == 1000


def test_a_batchs_step_leaves_out_tokens_the_client_read_together():
    """A client that got no CPU for a while reads several tokens at once: gaps of ~0
    (half of them in a busy run) are not engine steps; with them the median step was
    0 ms and a batch's spread 62,139 steps."""
    gaps = (0.0, 0.0, 0.0, 0.00002, 0.0, 0.012, 0.010, 0.0, 0.011, 0.0)
    b = Batch("kvd-1d", 0, 10.0, (10.1, 10.12), (10.5, 10.5), gaps, 2, 2)
    assert b.step_s == 0.011
    assert Batch("kvd-1d", 0, 10.0, (10.1,), (10.5,), (0.0, 0.0), 1, 1).step_s == 0.0


def test_failed_requests_are_counted_not_dropped():
    singles = [Single("nixl", 0, None, None, 0, 2, failed=2),
               Single("nixl", 1, 0.2, 0.3, 2, 2)]
    s = summarize("nixl", singles, [], {}, Counters())
    assert s.tokens_equal == "2/4"
    assert s.notes == ["2 of 4 requests gave no first token in time"]


def test_ratios_and_targets_are_against_the_better_nixl_setting():
    summaries = {
        "kvd-1d": summarize("kvd-1d", [Single("kvd-1d", 1, 0.08, 0.3, 2, 2)],
                            [_batch("kvd-1d", [0.1, 0.105])], {},
                            Counters(idle_cores_per_engine=0.02)),
        "kvd-2d": summarize("kvd-2d", [Single("kvd-2d", 1, 0.09, 0.3, 2, 2)],
                            [_batch("kvd-2d", [0.1, 0.13])], {}, Counters()),
        "nixl": summarize("nixl", [Single("nixl", 1, 0.3, 0.5, 2, 2)], [], {}, Counters()),
        "nixl-noprog": summarize("nixl-noprog", [Single("nixl-noprog", 1, 0.12, 0.4, 2, 2)],
                                 [], {}, Counters()),
    }
    add_ratios(summaries)
    assert summaries["kvd-1d"].ratio_handover_to_nixl == pytest.approx(0.67)
    t = targets(summaries)
    assert t["handover_le_0.8x_nixl"] is True
    assert t["batch_le_0.8x_nixl"] is None  # no NixlConnector batch in this run
    assert t["batch_within_one_step"] == {
        "client_side": {"kvd-1d": True, "kvd-2d": False},
        "co_scheduled": {"kvd-1d": None, "kvd-2d": None}}  # no traces in these
    assert t["one_daemon_not_slower_than_two"] is True
    assert t["idle_le_0.05_core"] is True


def test_breakdown_splits_a_hand_over_into_its_stages():
    stamps = {"prefill_sent": 0.0, "publish_sent": 0.1, "prefill_answered": 0.11,
              "decode_sent": 0.111, "decode_scheduled": 0.12, "pull_sent": 0.121,
              "daemon_pull": 0.122, "daemon_event": 0.126, "daemon_event_sent": 0.127,
              "event_taken": 0.13, "recv_reported": 0.13, "first_token": 0.14}
    out = breakdown(stamps, copy_s=0.004)
    assert out["pull sent to event taken (all)"] == 9.0
    assert out["  daemon took it -> event queued"] == 4.0
    assert out["  of which: to the daemon and the event back"] == 5.0
    assert out["hand-over (decode sent to first token)"] == 29.0
    assert "  pull sent -> daemon took it" in out


def test_first_transfer_is_the_first_rounds_pull_against_the_warm_rounds():
    stage = "pull sent to event taken (all)"
    rows = [{stage: 60.0}, {stage: 10.0}, {stage: 30.0}, {stage: 20.0}]
    out = first_transfers({"kvd-2d": rows, "kvd-1d": [{stage: 5.0}]})
    assert out == {"kvd-2d": {"first_ms": 60.0, "warm_p50_ms": 20.0, "x_warm": 3.0}}


def test_render_shows_every_system_and_the_targets():
    result = {
        "summaries": [vars(summarize("plain", [Single("plain", 1, None, 0.2, 1, 1)], [], {},
                                     Counters()))],
        "targets": {"idle_le_0.05_core": True},
        "host": {"cpus": 2, "load_before": 0.1, "load_after": 0.2},
        "config": {"rounds": 2, "batch": 6, "batch_rounds": 1, "prompt_tokens": 800,
                   "max_tokens": 16},
    }
    text = render(result)
    assert "| plain" in text and "target idle_le_0.05_core: True" in text


def test_an_engine_whose_port_was_taken_is_started_again_on_new_ports(tmp_path):
    """Another process on the host (another test's `kvd demo`) may take a picked port
    before the engine binds it: that exit is retried on new ports, BIND_TRIES times
    in all; any other exit is not."""
    import sys
    import time

    from kvd.tools.bench.vllm_launch import BIND_TRIES, Launch, Running
    from kvd.tools.bench.vllm_procs import Proc

    run = Running(system_spec("nixl-noprog"), {"prefill": 8100})
    args = engine_args("/m", 8100, 1 << 27, 2048, None)
    launch = Launch(run, "prefill", "p", args, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"})
    seen = {8100}
    for _ in range(BIND_TRIES - 1):
        assert launch.rebind()
        assert launch.port not in seen and run.ports["prefill"] == launch.port
        seen.add(launch.port)
        assert launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != "5600"
    assert not launch.rebind()  # it had its tries

    def exited(text: str) -> Proc:
        proc = Proc.start("e", [sys.executable, "-c", f"print({text!r}); raise SystemExit(1)"],
                          tmp_path)
        proc.proc.wait(timeout=30)
        return proc

    assert exited("OSError: [Errno 98] Address already in use").bind_failed()
    assert not exited("RuntimeError: out of memory").bind_failed()
    running = Proc.start("r", [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path)
    try:
        assert not running.bind_failed()  # still running: not an exit at all
        assert not running.port_taken()
    finally:
        running.proc.kill()
        running.proc.wait()
    # vLLM's NIXL handshake listener is a thread: its bind fails, the server lives on
    # and never answers (run 20's first try, 900 s lost): taken, to be started again
    listener = Proc.start("l", [sys.executable, "-c",
                                "print('zmq.error.ZMQError: Address already in use', "
                                "flush=True); import time; time.sleep(30)"], tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not listener.port_taken() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.port_taken() and not listener.bind_failed()
    finally:
        listener.stop()


def test_a_pairs_router_starts_and_answers(tmp_path):
    """The router of a P/D system (started again on a new port when its port was taken),
    here with no engine behind it: it answers its health check, and stops."""
    import time

    from kvd.tools.bench.vllm_launch import Running
    from kvd.tools.bench.vllm_procs import healthy
    from kvd.tools.bench.vllm_run import BenchConfig, VllmBench

    bench = VllmBench(BenchConfig(systems=("kvd-1d",)), tmp_path, tmp_path, log=lambda m: None)
    run = Running(system_spec("kvd-1d"), {"prefill": 1, "decode": 2})
    proc = bench.launcher.start_router(run)
    try:
        deadline = time.monotonic() + 60
        while not healthy(run.router_port):
            assert proc.proc.poll() is None, proc.tail()
            assert time.monotonic() < deadline, "router not up in 60 s"
            time.sleep(0.2)
        assert proc in run.procs
        assert "not up" in bench.launcher.not_up("router of kvd-1d not up", [proc])
    finally:
        proc.stop()


def test_a_kv_heavy_model_gets_a_kv_cache_for_two_of_its_longest_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--model-shape kv-heavy (64 KiB of KV a token) sizes each engine's KV cache for it;
    the default shape keeps the 128 MiB every earlier run had."""
    from typer.testing import CliRunner

    import kvd.tools.bench.vllm_run as vllm_run
    from kvd.errors import KvdError
    from kvd.tools.bench.cli import bench_app

    seen = []

    def capture(cfg, work_dir=None, log=None):
        seen.append(cfg)
        raise KvdError("captured")

    monkeypatch.setattr(vllm_run, "run_bench", capture)
    args = ["vllm", "--systems", "kvd-1d", "--prompt-tokens", "4096", "--max-tokens", "4",
            "--batch", "1"]
    assert CliRunner().invoke(bench_app, [*args, "--model-shape", "kv-heavy"]).exit_code != 0
    assert CliRunner().invoke(bench_app, args).exit_code != 0
    heavy, tiny = seen
    assert heavy.model_shape == "kv-heavy" and heavy.max_model_len == 4096 + 4 + 64
    assert heavy.kv_cache_bytes == 2 * heavy.max_model_len * (64 << 10)
    assert tiny.model_shape == "tiny" and tiny.kv_cache_bytes == 128 << 20
    bad = CliRunner().invoke(bench_app, [*args, "--model-shape", "huge"])
    assert bad.exit_code != 0 and "--model-shape must be one of" in bad.output
    assert len(seen) == 2


def test_each_engine_serves_a_request_of_its_own_before_round_0(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine warm-up: every engine of every system (prefill, decode, plain) gets
    one plain request, with no kv_transfer_params and a prompt no round or batch uses,
    before the first round; --no-engine-warm-up leaves it out."""
    import kvd.tools.bench.vllm_run as vllm_run
    from kvd.tools.bench.vllm_launch import Running
    from kvd.tools.bench.vllm_run import BenchConfig, VllmBench

    asked: list[tuple[int, dict]] = []
    monkeypatch.setattr(vllm_run, "stream_completion",
                        lambda port, body, timeout_s=0: asked.append((port, body)))
    cfg = BenchConfig(systems=("plain", "kvd-1d"), rounds=2, batch_rounds=1)
    bench = VllmBench(cfg, tmp_path, tmp_path, log=lambda m: None)
    bench.systems = {"plain": Running(system_spec("plain"), {"plain": 11}),
                     "kvd-1d": Running(system_spec("kvd-1d"), {"prefill": 12, "decode": 13})}
    order: list[str] = []
    monkeypatch.setattr(bench, "single_round", lambda rnd, names: order.append(f"r{rnd}"))
    monkeypatch.setattr(bench, "batch_round", lambda rnd, names: order.append(f"b{rnd}"))
    monkeypatch.setattr(bench, "decode_metrics",
                        lambda: order.append("metrics") or {})
    monkeypatch.setattr(bench, "idle_cores", lambda: {})
    bench.run()
    assert sorted(port for port, _ in asked) == [11, 12, 13]
    assert order[:2] == ["metrics", "r0"]  # warmed before the counters' baseline
    round_prompts = [bench._body(s)["prompt"] for s in (0, 1, 50_000)]
    for _, body in asked:
        assert "kv_transfer_params" not in body and body["prompt"] not in round_prompts

    asked.clear()
    off = VllmBench(BenchConfig(systems=("plain",), engine_warm_up=False), tmp_path,
                    tmp_path, log=lambda m: None)
    off.systems = {"plain": Running(system_spec("plain"), {"plain": 11})}
    monkeypatch.setattr(off, "single_round", lambda rnd, names: None)
    monkeypatch.setattr(off, "batch_round", lambda rnd, names: None)
    monkeypatch.setattr(off, "decode_metrics", lambda: {})
    monkeypatch.setattr(off, "idle_cores", lambda: {})
    off.run()
    assert asked == []
