"""`kvd demo` (the README's main command) runs end to end and checks its bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("args", [[], ["--kv-heads", "24", "--prefill-tp", "6", "--decode-tp",
                                       "4", "--decode-pp", "2", "--head-dim", "32"]])
def test_demo_is_byte_exact(args, tmp_path):
    res = subprocess.run([sys.executable, "-m", "kvd", "demo", "--tokens", "256", *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert not list(tmp_path.glob("kvd-demo-*")), "a demo that passed left its logs behind"
    runs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["request"] for r in runs] == ["req-1", "req-2"]
    assert all(r["ok"] and r["mismatched_elements"] == 0 and r["nbytes"] > 0 for r in runs)
    assert "byte-exact" in res.stdout.splitlines()[-1]
