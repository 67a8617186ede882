"""The reference pages name only paths and modules that exist.

A page that names `kvd/pool/hybrid.py` after the module moved sends a newcomer to
nothing; this reads every path (`kvd/...`, `tests/...`, `tools/...`, `scripts/...`, ...),
every path relative to a kvd package (`pool/adopt.py` in the layer drawing) and every
dotted module name (`kvd.transport.remote.rails`) in README.md, CONTRIBUTING.md and docs/*.md,
and fails on one that is not there. Dated notes (docs/notes/) are left as written.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = sorted(p.name for p in (ROOT / "kvd").iterdir() if (p / "__init__.py").is_file())
# A path from the repository root, a .py path inside one of kvd's packages, a dotted name.
ROOTED = re.compile(r"(?<![\w./-])(?:kvd|tests|tools|scripts|benchmarks|deploy|proto)/"
                    r"[\w./-]*[\w/]")
IN_PACKAGE = re.compile(r"(?<![\w./-])(?:" + "|".join(PACKAGES) + r")/[\w/]*\w\.py\b")
DOTTED = re.compile(r"(?<![\w./-])kvd(?:\.[A-Za-z_]\w*)+")


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def missing_in(text: str) -> list[str]:
    """What ``text`` names that is not in the repository."""
    missing = []
    for m in ROOTED.finditer(text):
        path = m.group(0).rstrip(".")
        if not any(c in path for c in "*<") and not (ROOT / path).exists():
            missing.append(path)
    for m in IN_PACKAGE.finditer(text):
        if not (ROOT / "kvd" / m.group(0)).exists() and not (ROOT / m.group(0)).exists():
            missing.append(m.group(0))
    for m in DOTTED.finditer(text):
        parts = m.group(0).split(".")
        if len(parts) == 2 and parts[1] not in PACKAGES and not _module_file(parts):
            continue  # `kvd.pull(...)`, `kvd.toml`: a variable or a file name, not a module
        n = len(parts)
        while n > 1 and _module_file(parts[:n]) is None:
            n -= 1
        module = _module_file(parts[:n]) if n > 1 else None
        if module is None or (n < len(parts) and not re.search(
                rf"\b{re.escape(parts[n])}\b", module.read_text())):
            missing.append(m.group(0))
    return missing


def test_reference_pages_name_only_paths_and_modules_that_exist() -> None:
    bad = {page.relative_to(ROOT).as_posix(): missing_in(page.read_text()) for page in PAGES}
    bad = {page: names for page, names in bad.items() if names}
    assert not bad, f"named in the docs but not in the repository: {bad}"


def test_the_check_finds_a_gone_module() -> None:
    assert missing_in("hybrid geometry (pool/hybrid.py)") == ["pool/hybrid.py"]
    assert missing_in("see `kvd/transport/gone.py`") == ["kvd/transport/gone.py"]
    assert missing_in("`kvd.transport.gone`, `kvd.config.no_such_name`") == [
        "kvd.transport.gone", "kvd.config.no_such_name"]
    assert missing_in("`kvd.config.load`, kvd/pool/, `kvd.pull(...)`, tests/*.py") == []
