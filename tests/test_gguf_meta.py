"""dgr.gguf_meta: one answer to "which layer, which role" for every reader of a GGUF.

The manifest and the planner used to decide global-tensor roles with two
rules that disagreed on DeepSeek-V4's `output_hc_*` (the hc_head that
collapses the hyper-connection streams after the last layer: a tail tensor).
These tests hold both users to the one rule on a real file, and hold
`read_header` (the fast header walk both use) to gguf-py's reader.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact.build import build_manifest
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import (
    Role,
    global_role,
    layer_of,
    layer_tensor_name,
    read_header,
    split_layer_name,
    tensor_data,
    tensor_role,
)
from dgr.models import default_model_path
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


def _gguf_py(path: Path) -> tuple[dict, list, int, list, gguf.GGUFReader]:
    r = gguf.GGUFReader(path, "r")
    fields = {k: f.contents() for k, f in r.fields.items()}
    tensors = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
               for t in r.tensors]
    return fields, tensors, r.data_offset, [t.data for t in r.tensors], r


def _every_value_type(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 2**32 - 1)
    w.add_int32("t.i32", -(2**31))
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1e-300)
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.empty", [])
    w.add_custom_alignment(64)
    w.add_tensor("blk.0.w", np.ones((3, 5), np.float32))
    w.add_tensor("v", np.ones(7, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("which", ["default model", "tiny tied", "every value type"])
def test_read_header_equals_gguf_py(tmp_path: Path, which: str) -> None:
    path = {"default model": lambda: default_model_path(),
            "tiny tied": lambda: write_tiny_llama(tmp_path / "t.gguf", tied=True, extra_globals=HC),
            "every value type": lambda: _every_value_type(tmp_path / "v.gguf")}[which]()
    header = read_header(path)
    fields, tensors, data_offset, data, reader = _gguf_py(path)
    assert dict(header.fields) == fields
    array = gguf.GGUFValueType.ARRAY
    assert dict(header.value_types) == {k: (int(f.types[0]), int(f.types[1]) if f.types[0] == array else None)
                                        for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.type, t.shape, t.offset, t.n_bytes) for t in header.tensors] == tensors
    assert header.data_offset == data_offset
    # tensor data: the same dtype, shape and bytes as gguf-py's views (what dequantize expects)
    file = np.memmap(path, dtype=np.uint8, mode="r")
    for t, want in zip(header.tensors, data, strict=True):
        got = tensor_data(file, t)
        assert (got.dtype, got.shape) == (want.dtype, want.shape), t.name
        assert np.array_equal(got, want), t.name


def test_tensor_data_refuses_a_tensor_past_the_end_of_the_file(tmp_path: Path) -> None:
    whole = _every_value_type(tmp_path / "v.gguf")
    header = read_header(whole)
    last = max(header.tensors, key=lambda t: t.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: last.offset + last.n_bytes - 1])  # the header is whole, the data is not
    file = np.memmap(cut, dtype=np.uint8, mode="r")
    with pytest.raises(CallerError) as err:
        tensor_data(file, read_header(cut).tensors[header.tensors.index(last)])
    assert err.value.reason is Reason.MODEL_LOAD_FAILED


def test_read_header_refuses_a_cut_or_foreign_file(tmp_path: Path) -> None:
    whole = _every_value_type(tmp_path / "v.gguf").read_bytes()
    for name, data in [("cut", whole[:200]), ("foreign", b"PK\x03\x04" + whole[4:]), ("empty-ish", whole[:10])]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        with pytest.raises(CallerError) as err:
            read_header(bad)
        assert err.value.reason is Reason.MODEL_LOAD_FAILED, name
