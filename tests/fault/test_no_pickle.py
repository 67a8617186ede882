"""No pickle or eval anywhere in kvd: the wire is msgpack via msgspec only."""

from __future__ import annotations

import ast
from pathlib import Path

import kvd

FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}
FORBIDDEN_CALLS = {"eval", "exec"}


def test_no_pickle_no_eval_in_kvd():
    root = Path(kvd.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                names = {node.func.id} & FORBIDDEN_CALLS
            else:
                continue
            bad = names & (FORBIDDEN_MODULES | FORBIDDEN_CALLS)
            if bad:
                offenders.append(f"{path.relative_to(root)}:{node.lineno} {sorted(bad)}")
    assert offenders == []
    assert len(list(root.rglob("*.py"))) > 10  # the walk really looked at the package
