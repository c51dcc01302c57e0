"""The command line: a service process imports only what its own command needs, and never pytest."""

from __future__ import annotations

import socket
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


def test_busy_polling_is_on_by_default_only_for_one_thread_llama_nodes_and_up_passes_it_on():
    """The measured case (one-thread llama.cpp shards, whose cores idle between a route's steps) polls;
    a 2-thread node, the stub and torch sleep as before; a given value wins, and `dgr up` hands it on."""
    from dgr.backends.base import LayerRange
    from dgr.cli import BUSY_POLL_MS, busy_poll_ms
    from dgr.up import node_args

    assert busy_poll_ms(None, "llama_shard", 1) == busy_poll_ms(None, "llama", 1) == BUSY_POLL_MS > 0
    assert busy_poll_ms(None, "llama_shard", 2) == busy_poll_ms(None, "stub", 1) == busy_poll_ms(None, "torch", 1) == 0
    assert busy_poll_ms(0, "llama_shard", 1) == 0 and busy_poll_ms(25, "stub", 4) == 25
    up = build_parser("up")
    given = node_args(up.parse_args(["up", "--busy-poll-ms", "30"]), LayerRange(0, 2), "http://t", "node0", 1)
    assert given[given.index("--busy-poll-ms") + 1] == "30.0"
    default = node_args(up.parse_args(["up"]), LayerRange(0, 2), "http://t", "node0", 1)
    assert "--busy-poll-ms" not in default  # the node picks its own default from its backend and threads


def _dgr_with_atexit(*argv: str, stop_when_ready: bool = False) -> subprocess.CompletedProcess:
    """`python -m dgr ARGV` with an atexit hook that prints 'teardown' (SIGTERM once it prints its ready line)."""
    import signal

    code = ("import atexit, runpy, sys; atexit.register(lambda: print('teardown', flush=True)); "
            f"sys.argv = ['dgr', *{list(argv)!r}]; runpy.run_module('dgr', run_name='__main__', alter_sys=True)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if stop_when_ready:
            line = p.stdout.readline()
            assert line.startswith("dgr-ready "), line
            p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, (line if stop_when_ready else "") + out, err)


def test_a_service_leaves_without_the_interpreters_teardown_and_keeps_its_output_and_exit_code():
    """A stopped node exits 0 with nothing of the interpreter's teardown run (dgr.cli.run says why); its
    output and a refusal's message and code still arrive; a tool exits the usual way."""
    served = _dgr_with_atexit("node", "--backend", "stub", "--port", "0", stop_when_ready=True)
    assert served.returncode == 0 and "teardown" not in served.stdout
    refused = _dgr_with_atexit("node", "--backend", "stub", "--port", "0", "--advertise", "ftp://x")
    assert refused.returncode == 2 and "dgr: error: --advertise must look like" in refused.stderr
    assert "teardown" not in refused.stdout
    tool = _dgr_with_atexit("plan", "--help")
    assert tool.returncode == 0 and tool.stdout.rstrip().endswith("teardown")


def test_a_bad_layer_range_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "dgr", "node", "--backend", "stub", "--layers", "5:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "argument --layers: bad layer range 5:1" in out.stderr
    assert "Traceback" not in out.stderr


def test_up_on_a_taken_port_says_so_before_starting_anything():
    """`dgr up` binds the tracker's socket itself (and hands it over): a taken port is its own error, at once."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "dgr", "up", "--backend", "stub", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"dgr up cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "starting" not in out.stderr and "Traceback" not in out.stderr


def test_a_tracker_given_a_listen_fd_that_is_no_socket_says_so():
    out = subprocess.run([sys.executable, "-m", "dgr", "tracker", "--listen-fd", "0"], stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--listen-fd 0 is not an open socket" in out.stderr
    assert "Traceback" not in out.stderr


def _children(pid: int) -> dict[str, int]:
    """The children of `pid`, by process name (comm)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    out = {}
    for child in pids:
        with open(f"/proc/{child}/comm") as f:
            out[f.read().strip()] = child
    return out


def _socket_inodes(pid: int) -> set[str]:
    import os

    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:["):-1])
    return out


def _listening_inode(port: int) -> str:
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                return fields[9]
    raise LookupError(port)


def test_dgr_up_forks_named_children_which_hold_only_their_own_descriptors_and_die_with_it():
    """`dgr up` forks its tracker and nodes (dgr.forks): each is named, only the tracker holds the
    listening socket, and a SIGKILLed `dgr up` takes its children with it."""
    import os
    import signal
    import time

    from dgr.testing.harness import LocalRoute

    with LocalRoute(backend="stub", nodes=2) as route:
        up = route.proc.pid
        children = _children(up)
        assert set(children) == {"dgr-tracker", "dgr-node0", "dgr-node1"}
        assert {children[f"dgr-node{i}"] for i in range(2)} == {route.node(f"node{i}")["pid"] for i in range(2)}
        listening = _listening_inode(route.port)
        assert listening in _socket_inodes(children["dgr-tracker"])
        assert listening not in _socket_inodes(up)  # handed over: the parent closed its copy
        for i in range(2):
            assert listening not in _socket_inodes(children[f"dgr-node{i}"])
        assert httpx_post_chat(route)["choices"][0]["finish_reason"] == "length"
        os.kill(up, signal.SIGKILL)
        route.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{pid}") for pid in children.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [name for name, pid in children.items() if os.path.exists(f"/proc/{pid}")]
        assert alive == []


def httpx_post_chat(route) -> dict:
    import httpx

    body = {"model": "stub", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{route.api}/chat/completions", json=body, timeout=30).json()


def test_dgr_up_whose_node_fails_to_start_says_which_and_stops_the_others(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "node1.key").write_text("not a key\n")
    p = subprocess.run([sys.executable, "-m", "dgr", "up", "--backend", "stub", "--nodes", "2", "--port", "0",
                        "--identity-dir", str(keys)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "node1 exited with code 2" in p.stderr and "dgr: error:" in p.stderr
    assert p.stdout == ""


@pytest.mark.parametrize("argv, said", [(["up", "--nodes", "0"], "argument --nodes: 0 is below 1"),
                                        (["node", "--ctx", "-5"], "argument --ctx: -5 is below 1"),
                                        (["node", "--max-sessions", "x"], "argument --max-sessions: 'x' is not a whole number")])
def test_a_count_below_one_is_a_usage_error(argv, said, capsys):
    """Not a node that starts, registers, and is refused by its tracker again and again, as `--ctx -5` was."""
    with pytest.raises(SystemExit) as exc:
        build_parser(_command(argv)).parse_args(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_dgr_up_cuts_for_the_work_it_is_told_to_expect_and_pipelines_prompts():
    """`dgr up` balances its nodes' layers for a chat turn's long prompt by default (SmolLM2: 15:15), for decode
    alone with --prompt-positions 0 (18:12: the tail also computes the LM head every token), and hands its
    tracker the prompt's pipeline cuts (dgr.tracker.live.pipeline_chunk)."""
    from dgr.backends.base import LayerRange
    from dgr.cli import PIPELINE_CUTS
    from dgr.models import default_model_path
    from dgr.up import route_splits, tracker_args

    up = build_parser("up")
    model = default_model_path()
    default = up.parse_args(["up", "--nodes", "2"])
    decode = up.parse_args(["up", "--nodes", "2", "--prompt-positions", "0"])
    assert route_splits(model, 30, 2, default.prompt_positions, default.answer_tokens) == [LayerRange(0, 15),
                                                                                          LayerRange(15, 30)]
    assert route_splits(model, 30, 2, decode.prompt_positions, decode.answer_tokens) == [LayerRange(0, 18),
                                                                                        LayerRange(18, 30)]
    cmd = tracker_args(default)
    assert cmd[cmd.index("--pipeline-cuts") + 1] == str(PIPELINE_CUTS)
    cmd = tracker_args(up.parse_args(["up", "--pipeline-cuts", "0"]))
    assert cmd[cmd.index("--pipeline-cuts") + 1] == "0"
    assert build_parser().parse_args(["tracker", "--pipeline-cuts", "8"]).pipeline_cuts == 8
