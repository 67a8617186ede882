"""`kvd bench` times its baselines between kvd's own measurements: the raw
NIXL stream (`RawStream`) alternates with kvd's repeats and the latency floor
(`FloorPipeline`) with kvd's 1-block pulls, so both see the same background load.
Real processes and NIXL READs, bytes checked."""

from __future__ import annotations

import pytest

from kvd.tools.bench.floor import POOL_BLOCKS, FloorPipeline
from kvd.tools.bench.raw import RawStream
from kvd.tools.bench.run import run_bench

pytestmark = pytest.mark.nixl


def test_raw_stream_reads_on_request_and_checks_its_bytes() -> None:
    stream = RawStream(8 << 20)
    try:
        times = [stream.read() for _ in range(3)]
    finally:
        verified = stream.close()
    assert verified is True
    assert all(0 < t < 10 for t in times)


def test_floor_pipeline_pulls_on_request_and_checks_every_block() -> None:
    floor = FloorPipeline(64 << 10, warmup=2)
    try:
        times = [floor.pull() for _ in range(POOL_BLOCKS)]
    finally:
        verified = floor.close()
    assert verified is True
    assert all(0 < t < 10 for t in times)


def test_bench_divides_kvd_by_the_stream_timed_between_its_repeats() -> None:
    res = run_bench(nbytes_mib=8, repeats=2, skip_hetero=True, latency_pulls=10,
                    concurrent_pulls=0)
    scn = res["scenarios"][0]
    assert scn["verified"] is True
    assert len(scn["nixl_shm_interleaved_ms"]) == 2  # one raw READ per kvd repeat
    assert scn["ratio_kvd_nixl_shm"] == round(scn["kvd_gbps"]
                                              / scn["nixl_gbps_shm_interleaved"], 3)
    assert scn["ratio_kvd_nixl_shm_separate"] == round(scn["kvd_gbps"] / scn["nixl_gbps_shm"], 3)
    # contiguous pulls (consecutive ids): byte-checked, divided by the stream timed
    # between their own repeats
    assert scn["verified_consecutive"] is True
    assert len(scn["kvd_ms_consecutive"]) == 2
    assert scn["ratio_kvd_nixl_shm_consecutive"] == round(
        scn["kvd_gbps_consecutive"] / scn["nixl_gbps_shm_interleaved_consecutive"], 3)
    assert "ratio_kvd_nixl_single_stream_contiguous" in res["targets"]["met"]
    # the floor's pulls took turns with kvd's: as many, every block read intact
    assert res["floor_1block_samples"] == 10 and res["floor_verified"] is True
    assert res["ratio_pull_1block_floor"] == round(res["pull_1block_p50_ms"]
                                                   / res["floor_1block_p50_ms"], 2)
