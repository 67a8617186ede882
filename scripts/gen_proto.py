"""Regenerate proto/kvd.schema.json, the language-neutral wire schema, from kvd.wire.protocol.

    python scripts/gen_proto.py          # rewrite it
    python scripts/gen_proto.py --check  # exit 1 if the committed file is stale (CI)

The schema is produced by ``kvd.wire.protocol.schema()`` (msgspec's JSON Schema of every
message struct plus the framing summary); proto/README.md describes the framing and
the request/reply pairs in prose. tests/test_proto_sync.py keeps both in step with
the code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvd.wire import protocol as kvd_protocol  # noqa: E402

SCHEMA_PATH = "proto/kvd.schema.json"


def schema_json() -> str:
    """The committed form: sorted keys, 2-space indent, trailing newline (stable diffs)."""
    return json.dumps(kvd_protocol.schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report a stale schema")
    args = parser.parse_args(argv)
    path = root / SCHEMA_PATH
    want = schema_json()
    if args.check:
        if not path.is_file() or path.read_text() != want:
            print(f"stale: {SCHEMA_PATH} (run python scripts/gen_proto.py)", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(want)
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
