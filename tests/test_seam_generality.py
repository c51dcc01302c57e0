"""A DeepSeek-V4-like model through the stub route: a seam 4 x hidden_size wide, token ids on every hop."""

from __future__ import annotations

import httpx
import openai

from dgr.backends.base import LayerRange
from dgr.backends.stub import DEEPSEEK_LIKE, StubBackend
from dgr.seam.wire import HEADER_SIZE
from dgr.testing.harness import LocalRoute
from dgr.testing.reference import expected_greedy


def test_wide_seam_with_token_ids_flows_end_to_end() -> None:
    spec = DEEPSEEK_LIKE
    assert spec.seam_width == 4 * spec.hidden_size and spec.hash_layers == 3
    whole = StubBackend(spec=spec, layers=LayerRange(0, spec.n_layers))
    prompt = "hash routed layers"
    want = expected_greedy([whole], whole.tokenize(prompt, add_special=True, parse_special=True), 24)
    with LocalRoute(nodes=3, extra=("--stub-model", "dsv4")) as route:
        model = httpx.get(f"{route.api}/models").json()["data"][0]
        assert (model["id"], model["dgr"]["seam_width"], model["dgr"]["hidden_size"]) == ("stub-dsv4", 256, 64)
        client = openai.OpenAI(base_url=route.api, api_key="unused", max_retries=0)
        got = client.completions.create(model="stub-dsv4", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.text
        for name in ("node1", "node2"):
            seam = route.node_status(name)["seam"]
            # one position: its token id (4 bytes) and 4 x hidden_size float32 values
            assert seam["last_decode_frame_bytes"] == HEADER_SIZE + 4 + 256 * 4
            assert seam["last_decode_hidden_bytes"] == 256 * 4
