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
