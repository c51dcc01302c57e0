"""Node loss as the official `openai` client sees it, through real processes.

What a loss does (the structured failure naming the node, survivors freed, no route without it, a hung
or slow node told from a dead one, the same tokens from a node that stalls) is proven exactly on trio's
MockClock on the default ring in process: tests/test_gateway_clock.py. A real process killed with
SIGKILL is in tests/test_chain.py (test_a_lost_node_is_named_by_its_neighbour) and
tests/test_faults_llama.py (its restart too). What stays here is what only a real server shows: the
`openai` client raising its APIError with dgr's reason and node from a stream cut by a loss.
"""

from __future__ import annotations

import openai
import pytest

from dgr.testing.harness import LocalRoute

# 4 ms per position per node, so the stream is still going when the node dies
DELAY = ("--stub-delay", "0.004", "--dead-after", "1")


def test_openai_client_raises_api_error_with_reason() -> None:
    with LocalRoute(nodes=2, extra=DELAY) as route:
        client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "go"}],
                                                max_tokens=400, temperature=0, stream=True)
        with pytest.raises(openai.APIError) as info:
            for i, chunk in enumerate(stream):
                if i == 3:
                    route.kill("node1")
        assert info.value.code == "route_node_lost"
        assert info.value.body["node"] == "node1"
