"""`kvd demo` (the README's main command) runs end to end, shows both pull paths (a
local copy on one daemon and a pull between two daemons), checks their bytes, and
leaves no shared-memory segment or temporary folder behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("args", [[], ["--kv-heads", "24", "--prefill-tp", "6", "--decode-tp",
                                       "4", "--decode-pp", "2", "--head-dim", "32"]])
def test_demo_is_byte_exact_on_both_paths(args, tmp_path: Path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "demo", "--tokens", "256", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    runs = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["request"] for r in runs] == ["local-1", "local-2", "remote-1", "remote-2"]
    # the path is the one the consumer daemon reports in its status
    assert [r["path"] for r in runs] == ["local", "local", "remote", "remote"]
    assert all(r["ok"] and r["mismatched_elements"] == 0 and r["producer_released"]
               for r in runs)
    assert len({r["nbytes"] for r in runs}) == 1 and runs[0]["nbytes"] > 0
    assert all(r["gbps"] > 0 for r in runs)
    last = out.splitlines()[-1]
    assert "byte-exact on both paths" in last
    assert "local copy" in last and "two daemons" in last
    # nothing left behind: the daemons' pools (named after the demo's pid) and its folders
    shm = Path("/dev/shm")
    if shm.is_dir():
        assert [p.name for p in shm.iterdir() if f"kvd-demo-{proc.pid}" in p.name] == []
    assert list(tmp.iterdir()) == []
