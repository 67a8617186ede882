"""kvd's package layout is its architecture: imports run one way, down the layers.

Read with ``ast`` over every module of ``kvd/`` (TYPE_CHECKING blocks and
function-local imports included, since a deferred import is still a dependency).
docs/architecture.md draws the same order; change both together.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvd"

# Lowest first. A module may import its own layer and any layer below it, never above.
LAYERS: list[tuple[str, ...]] = [
    ("kvd", "kvd.errors", "kvd.config"),
    ("kvd.planner",),
    ("kvd.transport",),
    ("kvd.wire",),
    ("kvd.pool",),
    ("kvd.client",),
    ("kvd.ops",),
    ("kvd.daemon",),
    ("kvd.integrations",),
    ("kvd.tools",),
    ("kvd.cli", "kvd.__main__"),
]
ROOT_MODULES = {"kvd", "kvd.errors", "kvd.config", "kvd.cli", "kvd.__main__"}

# Inside a layer, its sub-packages in order, lowest first (same rule: a module imports its
# own sub-layer and those below). Sub-packages in one tuple may import each other, except
# the SIBLINGS pairs, which never import each other.
SUBLAYERS: dict[str, list[tuple[str, ...]]] = {
    "kvd.daemon": [
        ("kvd.daemon", "kvd.daemon.clock", "kvd.daemon.transitions", "kvd.daemon.looplag",
         "kvd.daemon.datapath",
         "kvd.daemon.events", "kvd.daemon.direct", "kvd.daemon.faces", "kvd.daemon.curve_auth"),
        ("kvd.daemon.engines",),  # what each engine is, registration, liveness
        ("kvd.daemon.peers",),  # other daemons: handshakes, connections
        ("kvd.daemon.services", "kvd.daemon.hybrid"),
        ("kvd.daemon.produce", "kvd.daemon.pull"),  # the two sides of a transfer
        ("kvd.daemon.server", "kvd.daemon.run"),
    ],
    "kvd.planner": [
        ("kvd.planner",),
        ("kvd.planner.hybrid",),  # attention groups beside Mamba state, over the above
    ],
    "kvd.transport": [
        ("kvd.transport",),  # base: the protocols (Transport, Copier, Mover); loopback
        # NIXL reads, copies between mapped pools, same-host discovery: apart, over base
        ("kvd.transport.remote", "kvd.transport.copies", "kvd.transport.samehost"),
    ],
}
SIBLINGS = [("kvd.daemon.produce", "kvd.daemon.pull"),
            ("kvd.transport.remote", "kvd.transport.copies"),
            ("kvd.transport.remote", "kvd.transport.samehost"),
            ("kvd.transport.copies", "kvd.transport.samehost")]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix in ROOT_MODULES
            hit = module == prefix or (not exact_only and module.startswith(prefix + "."))
            if hit and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and the docs)")
    return best


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every kvd import in ``path``."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "kvd"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "kvd":
                continue
            names = [a.name for a in node.names]
            # `from kvd.pkg import sub` names a submodule: that is the real dependency.
            subs = [n for n in names if (ROOT / Path(*mod.split(".")[1:], n)).with_suffix(".py")
                    .exists() or (ROOT / Path(*mod.split(".")[1:], n) / "__init__.py").exists()]
            out += [(f"{mod}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                out.append((mod, rest, node.lineno))
    return out


MODULES = sorted(ROOT.rglob("*.py"))


def graph() -> dict[str, set[str]]:
    known = {module_name(p) for p in MODULES}
    edges: dict[str, set[str]] = {}
    for p in MODULES:
        me = module_name(p)
        edges[me] = {m for m, _, _ in imports_of(p) if m in known and m != me}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_anywhere_in_kvd():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_lower_layer_imports_a_higher_one():
    bad = []
    for p in MODULES:
        me = module_name(p)
        for mod, _, line in imports_of(p):
            if layer_of(mod) > layer_of(me):
                bad.append(f"{p.relative_to(ROOT.parent)}:{line}: {me} (layer "
                           f"{layer_of(me)}) imports {mod} (layer {layer_of(mod)})")
    assert not bad, "\n".join(bad)


def test_no_module_imports_another_modules_private_name():
    bad = []
    for p in MODULES:
        for mod, names, line in imports_of(p):
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{p.relative_to(ROOT.parent)}:{line}: {name} from {mod}")
    assert not bad, "\n".join(bad)


def sublayer_of(module: str, package: str) -> int:
    best, best_len = -1, -1
    for i, prefixes in enumerate(SUBLAYERS[package]):
        for prefix in prefixes:
            if prefix == package:  # the package's own modules, not its sub-packages
                hit = module == package or (module.rpartition(".")[0] == package
                                            and not (ROOT.parent / module.replace(".", "/")
                                                     ).is_dir())
            else:
                hit = module == prefix or module.startswith(prefix + ".")
            if hit and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no sub-layer of {package}: add it to SUBLAYERS")
    return best


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_no_sub_package_imports_a_higher_one_or_its_sibling():
    bad = []
    for p in MODULES:
        me = module_name(p)
        package = next((k for k in SUBLAYERS if _in(me, k)), None)
        if package is None:
            continue
        for mod, _, line in imports_of(p):
            if not _in(mod, package):
                continue
            where = f"{p.relative_to(ROOT.parent)}:{line}: {me} imports {mod}"
            if sublayer_of(mod, package) > sublayer_of(me, package):
                bad.append(where + " (a higher sub-layer)")
            if any((_in(me, a) and _in(mod, b)) or (_in(me, b) and _in(mod, a))
                   for a, b in SIBLINGS):
                bad.append(where + " (siblings never import each other)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("module", "package", "sub"), [
    ("kvd.daemon.clock", "kvd.daemon", 0), ("kvd.daemon.engines.table", "kvd.daemon", 1),
    ("kvd.daemon.pull.machine", "kvd.daemon", 4), ("kvd.daemon.server", "kvd.daemon", 5),
    ("kvd.planner.assembly", "kvd.planner", 0), ("kvd.planner.hybrid.plan", "kvd.planner", 1),
    ("kvd.transport.base", "kvd.transport", 0), ("kvd.transport.loopback", "kvd.transport", 0),
    ("kvd.transport.remote.nixl", "kvd.transport", 1),
    ("kvd.transport.copies.localcopy", "kvd.transport", 1),
])
def test_sublayer_of_known_modules(module, package, sub):
    assert sublayer_of(module, package) == sub


PULL = ROOT / "daemon" / "pull"
# What a pull may take from the bytes layer's parts at module level: same-host discovery.
# A copier or a NIXL agent is made inside a function (the one place that constructs it)
# and held through kvd.transport.base's protocols.
PULL_MAY_IMPORT = ("kvd.transport.base", "kvd.transport.samehost")


def module_level_kvd_imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
             ast.AsyncFunctionDef)) for n in ast.walk(f)}
    lines = {node.lineno for node in ast.walk(tree) if id(node) not in local
             and isinstance(node, (ast.Import, ast.ImportFrom))}
    return [(mod, line) for mod, _, line in imports_of(path) if line in lines]


def copier_annotations_of(path: Path) -> list[tuple[str, str, int]]:
    """(name, annotation, line) of every parameter or annotated name about a copier."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.arg) and node.annotation is not None:
            out.append((node.arg, ast.unparse(node.annotation), node.lineno))
        elif isinstance(node, ast.AnnAssign):
            out.append((ast.unparse(node.target), ast.unparse(node.annotation), node.lineno))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            out.append((node.name, ast.unparse(node.returns), node.lineno))
    return [(n, a, line) for n, a, line in out if "copier" in n.lower() or "_cuda" in n]


def test_pull_holds_the_bytes_layer_through_its_protocols():
    """kvd.daemon.pull types against kvd.transport.base (Mover, Copier): it imports no
    copier or NIXL module at module level, and no copier is held as ``Any``."""
    bad = []
    for p in sorted(PULL.rglob("*.py")):
        rel = p.relative_to(ROOT.parent)
        for mod, line in module_level_kvd_imports(p):
            if _in(mod, "kvd.transport") and not any(_in(mod, a) for a in PULL_MAY_IMPORT):
                bad.append(f"{rel}:{line}: imports {mod} at module level")
        for name, ann, line in copier_annotations_of(p):
            held = ann.replace("dict[str, Any]", "")  # keyword arguments, not a copier
            if re.search(r"\bAny\b|^'?object'?$", held):
                bad.append(f"{rel}:{line}: {name}: {ann} (use kvd.transport.base.Copier)")
    assert not bad, "\n".join(bad)


def test_the_protocols_check_sees_a_copier_as_any(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("def f(copier: Any, n: int) -> None: ...\n"
                   "class M:\n    _cuda: Any = None\n"
                   "def _cuda_copier() -> object: ...\n"
                   "def _for(copier: C) -> tuple[C, dict[str, Any]]: ...\n")
    found = copier_annotations_of(src)
    assert ("copier", "Any", 1) in found and ("_cuda", "Any", 3) in found
    assert ("_cuda_copier", "object", 4) in found
    assert all(n != "n" for n, _, _ in found)


def test_only_cli_config_and_errors_stay_at_the_root():
    top = sorted(p.stem for p in ROOT.glob("*.py"))
    assert top == ["__init__", "__main__", "cli", "config", "errors"], top


# The checks must catch what they claim to: run them on made-up graphs and sources.
def test_cycle_finder_sees_a_cycle_through_three_modules():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize(("module", "layer"), [
    ("kvd.planner.plan", 1), ("kvd.wire.protocol", 3), ("kvd.pool.shm", 4),
    ("kvd.daemon.engines.table", 7), ("kvd.cli", 10), ("kvd.errors", 0),
])
def test_layer_of_known_modules(module, layer):
    assert layer_of(module) == layer


def test_imports_of_sees_type_checking_and_private_names(tmp_path, monkeypatch):
    pkg = tmp_path / "kvd" / "planner"
    pkg.mkdir(parents=True)
    (tmp_path / "kvd" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (tmp_path / "kvd" / "daemon").mkdir()
    (tmp_path / "kvd" / "daemon" / "__init__.py").write_text("")
    (tmp_path / "kvd" / "daemon" / "server.py").write_text("")
    src = pkg / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from kvd.daemon import server\nfrom kvd.planner.y import _hidden\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path / "kvd")
    found = imports_of(src)
    assert ("kvd.daemon.server", [], 3) in found
    assert ("kvd.planner.y", ["_hidden"], 4) in found


# Heavy or optional third-party packages: imported only where docs/architecture.md says.
ARCH_DOC = ROOT.parent / "docs" / "architecture.md"
GUARDED = ("vllm", "nixl", "torch", "aiohttp", "typer", "opentelemetry")
# nixl ships as nixl, nixl_cu12 or nixl_cu13; one name for all three.
ALIASES = {"nixl_cu12": "nixl", "nixl_cu13": "nixl"}
# Modules that import by a computed name (importlib.import_module(f"...")), and what.
DYNAMIC_IMPORTS = {"kvd.transport.remote.nixl": "nixl"}


def allowed_importers() -> dict[str, list[str]]:
    """package -> the paths (files, or folders ending in /) the doc's table allows."""
    out = {}
    for line in ARCH_DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] in GUARDED:
            out[cells[0]] = [p.strip() for p in cells[1].split(",")]
    return out


def third_party_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(guarded package, line, at module level) of every import of one in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
             ast.AsyncFunctionDef)) for n in ast.walk(f)}
    out = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names = [arg.value]
            else:
                names = [DYNAMIC_IMPORTS.get(module_name(path), "<computed name>")]
        for name in names:
            top = ALIASES.get(name.split(".")[0], name.split(".")[0])
            if top in GUARDED or top == "<computed name>":
                out.append((top, node.lineno, id(node) not in local))
    return out


def test_architecture_doc_lists_every_guarded_package():
    assert sorted(allowed_importers()) == sorted(GUARDED)


@pytest.mark.parametrize("package", GUARDED)
def test_heavy_packages_are_imported_only_where_the_docs_say(package):
    allowed = allowed_importers()[package]
    bad = []
    for p in MODULES:
        rel = p.relative_to(ROOT.parent).as_posix()
        for top, line, _ in third_party_imports(p):
            if top == "<computed name>":
                bad.append(f"{rel}:{line}: import by a computed name: add the module "
                           "to DYNAMIC_IMPORTS")
            elif top == package and not any(rel == a or (a.endswith("/") and
                                                         rel.startswith(a)) for a in allowed):
                bad.append(f"{rel}:{line}: imports {package}")
    assert not bad, ("not where docs/architecture.md allows:\n" + "\n".join(bad))


def test_torch_is_imported_only_inside_functions():
    bad = [f"{p.relative_to(ROOT.parent)}:{line}" for p in MODULES
           for top, line, top_level in third_party_imports(p) if top == "torch" and top_level]
    assert not bad, "torch imported at module level (a daemon would load it): " + str(bad)


def test_connector_core_imports_without_vllm():
    """The connector's logic is importable where vLLM is not installed (the default
    suite's environment): every module of kvd.integrations.connector_core."""
    import subprocess
    import sys

    names = sorted(module_name(p) for p in (ROOT / "integrations" / "connector_core")
                   .glob("*.py"))
    code = ("import sys, importlib\n"
            "class NoVllm:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'vllm': raise ImportError('no vllm here')\n"
            "sys.meta_path.insert(0, NoVllm())\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout  # neither vLLM nor torch loaded


def test_third_party_finder_sees_local_dynamic_and_from_imports(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import typer\nfrom vllm.config import X\n"
                   "def f():\n    import torch\n    importlib.import_module('aiohttp.web')\n")
    found = third_party_imports(src)
    assert ("typer", 1, True) in found and ("vllm", 2, True) in found
    assert ("torch", 4, False) in found and ("aiohttp", 5, False) in found


def test_the_pull_machine_and_its_rules_load_no_io() -> None:
    """The sans-IO pull (and its table, inputs, actions and Acquire rules) imports nothing that
    does I/O: a simulator, a unit test or another driver can run it without a loop, a
    socket, metrics or a transport (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvd.daemon.pull.machine, kvd.daemon.pull.state, kvd.daemon.pull.actions\n"
            "import kvd.daemon.pull.acquire, kvd.daemon.pull.inputs\n"
            "bad = [m for m in ('asyncio', 'zmq', 'prometheus_client', 'nixl', 'nixl_cu12',\n"
            "       'uvloop', 'torch') if m in sys.modules]\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "", f"the pull's machine loads {out.stdout.strip()}"
