"""proto/ stays in step with kvd/wire/protocol.py: the committed JSON Schema is exactly what
scripts/gen_proto.py generates, and proto/README.md names every message and error code."""

from __future__ import annotations

import importlib.util
import inspect
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import msgspec

from kvd.errors import ERRORS_BY_CODE
from kvd.wire import protocol as P

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "proto/README.md"
# Codes the daemon sends without an exception class of their own (kvd/daemon/server.py).
EXTRA_CODES = ("unauthorized", "internal")


def _gen_proto() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts/gen_proto.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_proto", module)
    spec.loader.exec_module(module)
    return module


GEN = _gen_proto()


def _structs() -> list[type]:
    return [obj for _, obj in inspect.getmembers(P, inspect.isclass)
            if issubclass(obj, msgspec.Struct) and obj.__module__ == P.__name__]


def test_committed_schema_matches_code() -> None:
    path = ROOT / GEN.SCHEMA_PATH
    assert path.is_file(), f"{GEN.SCHEMA_PATH} missing: run python scripts/gen_proto.py"
    assert path.read_text() == GEN.schema_json(), (
        f"{GEN.SCHEMA_PATH} is stale (kvd/wire/protocol.py changed): "
        "run python scripts/gen_proto.py"
    )


def test_schema_covers_every_struct_and_the_version() -> None:
    schema = json.loads((ROOT / GEN.SCHEMA_PATH).read_text())
    assert schema["protocol_version"] == P.PROTOCOL_VERSION
    assert set(schema["$defs"]) == {cls.__name__ for cls in _structs()}
    assert schema["notification"] == {"prefix": P.NOTICE_MAGIC.decode(), "body": "ReadNotice"}


def test_check_mode_detects_a_stale_schema(tmp_path: Path) -> None:
    assert GEN.main(["--check"], root=tmp_path) == 1  # missing
    assert GEN.main([], root=tmp_path) == 0
    assert GEN.main(["--check"], root=tmp_path) == 0
    stale = tmp_path / GEN.SCHEMA_PATH
    stale.write_text(stale.read_text().replace('"protocol_version"', '"protocol_versio"'))
    assert GEN.main(["--check"], root=tmp_path) == 1


def test_readme_describes_every_message() -> None:
    text = README.read_text()
    missing = [cls.__name__ for cls in _structs() if f"`{cls.__name__}`" not in text]
    assert not missing, f"proto/README.md does not describe {missing}"


def test_readme_lists_every_error_code() -> None:
    text = README.read_text()
    missing = [code for code in (*ERRORS_BY_CODE, *EXTRA_CODES) if f"| `{code}` |" not in text]
    assert not missing, f"proto/README.md error table lacks {missing}"


def test_readme_request_reply_pairs_match_the_faces() -> None:
    """Each face's table lists exactly the requests that face's decoder accepts."""
    text = README.read_text()
    engine = text.split("### Engine face", 1)[1].split("### Peer face", 1)[0]
    peer = text.split("### Peer face", 1)[1].split("###", 1)[0]

    def requests(section: str) -> set[str]:
        return set(re.findall(r"^\| `(\w+)` \| `\w+` \|", section, flags=re.M))

    assert requests(engine) == {c.__name__ for c in P.ENGINE_REQUESTS}
    assert requests(peer) == {c.__name__ for c in P.PEER_REQUESTS}
    for section in (engine, peer):
        for req, rep in re.findall(r"^\| `(\w+)` \| `(\w+)` \|", section, flags=re.M):
            assert getattr(P, rep) in P.REPLIES, f"{req} -> {rep}: not a reply struct"


def test_readme_names_the_current_version() -> None:
    text = README.read_text()
    assert f"Current version: **{P.PROTOCOL_VERSION}**" in text
    history = text.split("## Version history", 1)[1]
    assert re.search(rf"^\| {P.PROTOCOL_VERSION} \|", history, flags=re.M)


def test_notice_framing_is_as_documented() -> None:
    notice = P.ReadNotice(request_id="r", producer_engine_id="p", consumer_engine_id="c",
                          reads=2)
    raw = P.encode_notice(notice)
    assert raw.startswith(b"kvd1") and f'`{P.NOTICE_MAGIC.decode()}`' in README.read_text()
    body = msgspec.msgpack.decode(raw[4:])
    assert isinstance(body, dict)  # a msgpack map keyed by field name, as documented
    assert body == msgspec.structs.asdict(notice)
    assert P.decode_notice(raw) == notice


def test_header_is_decoded_first_and_unknown_header_fields_are_ignored() -> None:
    """The documented forward-compat rule, checked against the real decoder."""
    enc = msgspec.msgpack.encode
    body = enc({"engine_id": "e", "tp_rank": 0})
    header = {"v": P.PROTOCOL_VERSION, "kind": "Ping", "id": 7, "token": "", "mac": b"x"}
    h, msg = P.decode([enc(header), body], P.ENGINE_REQUESTS)
    assert h.id == 7 and msg == P.Ping(engine_id="e", tp_rank=0)
    # Version is checked before the body: garbage body, wrong version -> 'incompatible'.
    try:
        P.decode([enc({**header, "v": 99}), b"\xc1garbage"], P.ENGINE_REQUESTS)
    except P.ProtocolError as exc:
        assert exc.code == "incompatible"
    else:
        raise AssertionError("version mismatch accepted")
