"""One home per kind of tooling: each ``kvd`` command besides the daemon's own is a
package of kvd/tools/ named for it, and kvd/tools/ holds nothing else but the harness
those commands share; repository upkeep lives in scripts/ (CONTRIBUTING.md, "Where
things go")."""

from __future__ import annotations

from pathlib import Path

from kvd.cli import app

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "kvd" / "tools"
DAEMON_COMMANDS = {"serve", "keys", "status"}  # the daemon's own: kvd/daemon, kvd/ops
SHARED = {"sim", "localcluster"}  # the harness the commands (and the tests) share


def commands() -> set[str]:
    names = {c.name or c.callback.__name__ for c in app.registered_commands}
    return names | {g.name for g in app.registered_groups}


def test_every_tool_command_has_a_package_named_for_it() -> None:
    missing = [name for name in sorted(commands() - DAEMON_COMMANDS)
               if not (TOOLS / name.replace("-", "_") / "__init__.py").is_file()]
    assert not missing, f"kvd commands without a package under kvd/tools/: {missing}"


def test_kvd_tools_holds_only_command_packages_and_their_harness() -> None:
    packages = {p.name for p in TOOLS.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in TOOLS.glob("*.py")} - {"__init__"}
    wanted = {name.replace("-", "_") for name in commands() - DAEMON_COMMANDS}
    assert packages == wanted, (packages ^ wanted)
    assert modules <= SHARED, f"loose modules in kvd/tools/: {sorted(modules - SHARED)}"


def test_no_third_home_for_tooling() -> None:
    assert not (ROOT / "tools").exists(), "repository upkeep goes to scripts/"
