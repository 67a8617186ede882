"""tests/ mirrors the package, and no folder of it can hide a package the tests import.

The tests of ``kvd/<part>/`` live in ``tests/<part>/`` (kinds of test are markers, not
folders); ``tests/support/`` holds shared helpers and ``tests/deploy/`` checks the
repository's ``deploy/``.

pytest's default import mode ("prepend") puts on sys.path, for each test module and
conftest.py, the first folder above it that has no ``__init__.py``. Whatever such a
folder holds is then importable by its bare name: a subfolder ``vllm`` there would be the
top-level ``vllm`` (hiding the real one, or posing as it where vLLM is absent, which
defeats ``pytest.importorskip``). So no folder that could be put there may hold an entry
named like an installed or standard-library module.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NOT_MIRRORS = {"support", "deploy"}  # helpers; the repository's deploy/ folder
# Imported by the tests or kvd, and maybe not installed in this environment.
ALWAYS_TAKEN = {"vllm", "nixl", "nixl_cu12", "nixl_cu13", "torch", "kvd", "tests"}


def _folders() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*")
                  if p.is_dir() and p.name != "__pycache__" and not p.name.startswith("."))


def test_every_folder_is_a_part_of_kvd() -> None:
    strays = []
    for folder in _folders():
        rel = folder.relative_to(TESTS)
        if rel.parts[0] in NOT_MIRRORS:
            assert rel.parts[0] != "deploy" or (ROOT / "deploy").is_dir()
            continue
        if not (ROOT / "kvd" / rel / "__init__.py").is_file():
            strays.append(str(rel))
    assert not strays, f"folders under tests/ that name no package of kvd: {strays}"


def test_no_folder_on_sys_path_shadows_a_module() -> None:
    taken = (set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
             | ALWAYS_TAKEN)
    shadows = []
    for folder in [TESTS, *_folders()]:
        if (folder / "__init__.py").is_file():
            continue  # inside a package: pytest puts a folder above it on sys.path
        for entry in folder.iterdir():
            name = entry.stem if entry.suffix == ".py" else entry.name
            if name in taken and (entry.is_dir() or entry.suffix == ".py"):
                shadows.append(str(entry.relative_to(ROOT)))
    assert not shadows, f"would shadow a module of the same name on sys.path: {shadows}"


def imported_test_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every test module (``test_*``) that ``path`` imports, by bare name
    (pytest's sys.path) or through the ``tests`` package."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[-1].startswith("test_") and (
                    "." not in name or name.split(".")[0] in ("tests", "support")):
                out.append((name, node.lineno))
    return out


def test_no_test_module_is_imported_by_another() -> None:
    """What tests share lives in tests/support/: importing a test module runs its
    module-level fixtures and marks, and collects its tests a second time."""
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {name}"
           for p in sorted(TESTS.rglob("*.py")) for name, line in imported_test_modules(p)]
    assert not bad, "\n".join(bad)


def test_the_import_check_sees_bare_and_package_imports(tmp_path) -> None:
    src = tmp_path / "x.py"
    src.write_text("from test_matrix import CASES\nimport pytest\n"
                   "from tests.daemon.pull.test_hybrid import spec\n"
                   "from support.matrix_cases import CASES\nfrom kvd.x import test_y\n")
    found = [n for n, _ in imported_test_modules(src)]
    assert found == ["test_matrix", "tests.daemon.pull.test_hybrid"]


# A tracker's number means nothing to a reader of the code (CONTRIBUTING.md, "Commits").
TRACKER = __import__("re").compile(r"\b[Ii]ssues? #?\d+(\.\d+)?\b")


def test_no_tracker_references_in_code_or_tests() -> None:
    bad = []
    for tree in ("kvd", "tests", "scripts", "benchmarks"):
        for p in sorted((ROOT / tree).rglob("*")):
            if p.suffix not in (".py", ".sh", ".c") or "__pycache__" in p.parts:
                continue
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
                if TRACKER.search(line) and p.name != "test_tests_layout.py":
                    bad.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_tracker_pattern() -> None:
    assert TRACKER.search("noticed (issue 21.4) here") and TRACKER.search("issues 20.4, 21")
    assert not TRACKER.search("an issue with 3 peers") and not TRACKER.search("NIXL PR #2047")
