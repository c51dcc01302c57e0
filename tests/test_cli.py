"""The command line: a service process imports only what its own command needs, and never pytest."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dgr.cli import _TOOLS, _command, build_parser

TOOL_MODULES = sorted(_TOOLS.values())


@pytest.mark.parametrize("command", ["tracker", "node", "up"])
def test_a_service_command_imports_no_tool(command):
    # every route start pays its processes' imports; the tools' (plan, bench, artifact, soak) cost about 0.5 s
    # of CPU each time, for subcommands these processes never run
    probe = ("import sys; from dgr.cli import _command, build_parser; "
             f"build_parser(_command(['-v', {command!r}, '--port', '0']))\n"
             f"print(sorted(m for m in {TOOL_MODULES!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_help_and_a_tool_command_still_see_every_command(capsys):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"tracker", "node", "up", *_TOOLS}
    assert build_parser(_command(["-v", "plan", "--nodes", "2"])).parse_args(["plan", "--nodes", "2"]).nodes == 2
    with pytest.raises(SystemExit):  # a mistyped command is told every command there is
        build_parser(_command(["frob"])).parse_args(["frob"])
    told = capsys.readouterr().err
    assert all(f"'{name}'" in told for name in _TOOLS)


def test_service_processes_never_import_the_test_framework():
    # the scheduler takes trio.testing's wait_all_tasks_blocked from trio._core, where trio defines it
    import trio._core
    import trio.testing

    assert trio._core.wait_all_tasks_blocked is trio.testing.wait_all_tasks_blocked
    probe = "import sys, dgr.node.run, dgr.tracker.run, dgr.up; print('pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
