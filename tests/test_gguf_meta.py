"""dgr.gguf_meta: one answer to "which layer, which role" for every reader of a GGUF.

The manifest and the planner used to decide global-tensor roles with two
rules that disagreed on DeepSeek-V4's `output_hc_*` (the hc_head that
collapses the hyper-connection streams after the last layer: a tail tensor).
These tests hold both users to the one rule on a real file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact.build import build_manifest
from dgr.gguf_meta import Role, global_role, layer_of, layer_tensor_name, split_layer_name, tensor_role
from dgr.plan import layout_from_gguf

HC = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")


def test_names_and_rule() -> None:
    assert split_layer_name("blk.12.attn_q.weight") == (12, "attn_q.weight")
    assert layer_of("blk.3.ffn_up.weight") == 3
    assert layer_of("output_hc_fn.weight") is None
    assert layer_of("blkx.3.w") is None
    assert layer_tensor_name(7, "attn_k.weight") == "blk.7.attn_k.weight"
    for name in HC:
        assert global_role(name, tied=False) is Role.TAIL
    assert global_role("token_embd.weight", tied=True) is Role.HEAD_TAIL
    assert global_role("token_embd.weight", tied=False) is Role.HEAD
    assert global_role("token_embd_norm.weight", tied=True) is Role.HEAD
    assert global_role("output.weight", tied=False) is Role.TAIL
    assert global_role("output_norm.weight", tied=True) is Role.TAIL
    assert global_role("rope_freqs.weight", tied=True) is Role.SHARED
    assert tensor_role("blk.0.attn_q.weight", tied=True) is Role.LAYER


@pytest.mark.parametrize("tied", [True, False])
def test_manifest_and_planner_agree_on_global_roles(tmp_path: Path, tied: bool) -> None:
    path = write_tiny_llama(tmp_path / "hc.gguf", tied=tied, extra_globals=(*HC, "rope_freqs.weight"))
    manifest = {t.name: t.role for t in build_manifest(path).tensors if t.layer is None}
    planner = {g.name: g.role for g in layout_from_gguf(path).globals}
    assert manifest == planner
    assert all(manifest[name] is Role.TAIL for name in HC)
    assert manifest["rope_freqs.weight"] is Role.SHARED
    assert manifest["token_embd.weight"] is (Role.HEAD_TAIL if tied else Role.HEAD)
