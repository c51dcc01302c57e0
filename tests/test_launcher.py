"""The tests' launcher (dgr.testing.launcher): a `dgr` command forked from a pre-imported server behaves
as the same command started with `python -m dgr`, seen through a Popen-like handle."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from dgr.procs import WatchedChild, dgr_command
from dgr.testing import launcher
from dgr.testing.launcher import launch


def test_a_usage_error_arrives_with_its_message_and_exit_code() -> None:
    p = launch(dgr_command("node", "--backend", "stub", "--layers", "5:1"), env=dict(os.environ),
               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out = p.stdout.read()
    assert p.wait(30) == 2 and p.returncode == 2 and p.poll() == 2
    assert "argument --layers: bad layer range 5:1" in out and "Traceback" not in out


def test_a_service_runs_in_the_environment_it_was_given_and_stops_on_sigterm(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"}
    env["XDG_CONFIG_HOME"] = str(tmp_path)  # where a node without --identity keeps its key
    p = launch(dgr_command("node", "--backend", "stub", "--port", "0"), env=env, stdout=subprocess.PIPE,
               stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    child = WatchedChild.watch("node", p)
    try:
        assert child.wait_ready(60)["url"].startswith("http://127.0.0.1:")
        assert (tmp_path / "dgr" / "node.key").exists()
        with open(f"/proc/{p.pid}/stat") as f:  # forked by the launcher's server, not started by this process
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == launcher._LAUNCHER.server.pid != os.getpid()
        assert p.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.05)
    finally:
        p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    p.send_signal(signal.SIGTERM)  # a gone process is no error, as with Popen


def test_only_dgr_commands_are_launched() -> None:
    with pytest.raises(ValueError, match="dgr commands only"):
        launch(["/bin/true"], env={})
