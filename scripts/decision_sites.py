"""Run: .venv/bin/python scripts/decision_sites.py [ROOT] [-v]

Decision sites about a pull outside its machine, counted the same way every time.

A site is a branch point (``if``/``elif``, ``x if c else y``, ``while``, a
comprehension's ``if``, a ``match`` case) in kvd/daemon/pull/*.py other than
machine.py, state.py, actions.py, inputs.py and __init__.py, whose condition reads the
pull's record (``pull``, ``self.pull``), an action's fields (``act.``) or a fact a
pull's fate hangs on (``reply``, ``engine``, ``remote``, ``_maps``). Dispatch on the
action's kind (``isinstance(act, X)``) is not counted: that is carrying an action out,
not deciding. ROOT: a kvd checkout (default: this one); ``-v`` lists every site.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

SKIP = {"machine.py", "state.py", "actions.py", "inputs.py", "__init__.py"}
READS = re.compile(r"\b(self\.pull|pull|act|reply|engine|self\.engine|remote|_maps)\b")
DISPATCH = re.compile(r"isinstance\(act, \w+\)")


def sites(path: Path) -> list[tuple[int, str]]:
    src = path.read_text()
    out = []
    for node in ast.walk(ast.parse(src)):
        tests: list[ast.AST] = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        elif isinstance(node, ast.match_case):
            tests = [node.pattern]
        for t in tests:
            text = ast.get_source_segment(src, t) or ""
            if not DISPATCH.fullmatch(text) and READS.search(text):
                out.append((t.lineno, " ".join(text.split())))
    return sorted(out)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "-v"]
    root = Path(args[0]) if args else Path(__file__).resolve().parents[1]
    total = 0
    for f in sorted((root / "kvd/daemon/pull").glob("*.py")):
        if f.name in SKIP:
            continue
        found = sites(f)
        total += len(found)
        print(f"{f.name}: {len(found)}")
        if "-v" in sys.argv:
            for line, text in found:
                print(f"    {line}: {text[:100]}")
    print(f"total: {total}")


if __name__ == "__main__":
    main()
