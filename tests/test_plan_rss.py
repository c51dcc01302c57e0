"""`dgr plan` against the real memory of `dgr up` nodes (RSS), within 15%."""

from __future__ import annotations

import pytest

from dgr.models import default_model_path
from dgr.backends.base import LayerRange
from dgr.plan import Node, PlanParams, layout_from_gguf, shard_cost
from dgr.testing.harness import LocalRoute

pytestmark = [pytest.mark.llama, pytest.mark.serial]
import llama_cpp  # noqa: F401  a hard dependency: a broken build fails here

CTX, SESSIONS = 2048, 2


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# One node serving the whole model is test_plan.py's test_plan_matches_rss_of_a_real_llamacpp_node,
# against a bare llama.cpp process and a tighter bound; here, the shards of a real route. Three
# nodes price all three kinds of shard (head, middle, tail); a 2-node route has no kind they lack.
@pytest.mark.parametrize("nodes", [3])
def test_plan_matches_node_rss(nodes: int) -> None:
    backend = "llama" if nodes == 1 else "llama_shard"
    with LocalRoute(backend=backend, nodes=nodes, ready_timeout_s=300,
                    extra=("--ctx", str(CTX), "--max-sessions", str(SESSIONS), "--pipeline-cuts", "0")) as route:
        # one request past a full 512-row ubatch, so compute and output buffers reach their serving size: the
        # planner prices the ubatch a node may be sent (a one-node route's, or a long prompt's), and a pipeline's
        # finer chunks (--pipeline-cuts, dgr.tracker.live) would leave this short prompt's below it
        import httpx

        httpx.post(f"{route.api}/completions", timeout=120,
                   json={"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "warm up " * 300, "max_tokens": 4})
        measured = {n["node"]: _rss_bytes(n["pid"]) for n in route.node_table()}
        layers = {n["node"]: n["layers"] for n in route.node_table()}
    layout = layout_from_gguf(default_model_path())
    params = PlanParams(context=CTX, sessions=SESSIONS)
    for name, text in sorted(layers.items()):
        cost = shard_cost(layout, params, Node(name, 64 << 30), LayerRange.parse(text))
        ratio = measured[name] / cost.total_bytes
        print(f"{name} {text}: RSS {measured[name] / 2**20:.1f} MiB, plan {cost.total_bytes / 2**20:.1f} MiB, "
              f"ratio {ratio:.3f}")
        assert 0.85 <= ratio <= 1.15, (name, ratio)
