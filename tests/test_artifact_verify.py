"""Verifying files against manifests: exact blame, layer ranges, clear structural errors, the CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fixtures.artifact_helpers import run_artifact_cli as _cli
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact.cli import EXIT_ERROR, EXIT_MISMATCH, EXIT_OK
from dgr.artifact.constants import GlobalNeed
from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest
from dgr.artifact.verify import verify_file
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason


def _flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_default_model_verifies_whole_and_by_range(manifest: Manifest, model_path: Path) -> None:
    whole = verify_file(model_path, manifest)
    assert whole.ok and whole.bytes_checked == manifest.header.length + sum(t.size for t in manifest.tensors)
    assert [r.index for r in whole.results] == [None] + list(range(30))
    part = verify_file(model_path, manifest, LayerRange(10, 20))
    assert part.ok and [r.index for r in part.results] == list(range(10, 20))
    # A middle range computes with no global tensor; the loader wants them all.
    loader = verify_file(model_path, manifest, LayerRange(10, 20), need=GlobalNeed.LOADER)
    assert [r.index for r in loader.results] == [None] + list(range(10, 20))


def test_one_flipped_byte_in_layer_7_is_blamed_exactly(manifest: Manifest, model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / model_path.name
    shutil.copyfile(model_path, copy)
    target = manifest.tensor("blk.7.ffn_gate.weight")
    _flip(copy, target.offset + target.size // 2)

    report = verify_file(copy, manifest)
    assert not report.ok
    assert report.bad_layers == [7]
    assert report.bad_tensors == ["blk.7.ffn_gate.weight"]
    bad = [r for r in report.results if not r.ok]
    assert [(r.index, r.bad) for r in bad] == [(7, ("blk.7.ffn_gate.weight",))]
    assert "layer 7: MISMATCH in blk.7.ffn_gate.weight" in report.lines()
    with pytest.raises(CallerError) as err:
        report.raise_for_mismatch()
    assert err.value.reason is Reason.ARTIFACT_MISMATCH
    assert "layer 7: blk.7.ffn_gate.weight" in err.value.message
    assert err.value.details["tensors"] == ["blk.7.ffn_gate.weight"]
    # Damage outside a range does not fail that range.
    assert verify_file(copy, manifest, LayerRange(10, 20)).ok
    assert verify_file(copy, manifest, LayerRange(5, 8)).bad_layers == [7]


def test_truncated_file_is_a_clear_error(manifest: Manifest, model_path: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    layer20 = manifest.layers[20].ranges[0]
    with model_path.open("rb") as f:
        cut.write_bytes(f.read(layer20[0] + 1000))
    with pytest.raises(CallerError, match="truncated") as err:
        verify_file(cut, manifest)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED
    assert 20 in err.value.details["layers"]
    # Cut inside the header: gguf-py cannot parse it, and we say so.
    head = tmp_path / "head.gguf"
    with model_path.open("rb") as f:
        head.write_bytes(f.read(100_000))
    with pytest.raises(CallerError, match="truncated or corrupt") as err:
        verify_file(head, manifest)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED


def test_non_gguf_file_is_a_clear_error(manifest: Manifest, tmp_path: Path) -> None:
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"\x89PNG" + bytes(5000))
    with pytest.raises(CallerError, match="not a GGUF") as err:
        verify_file(junk, manifest)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED
    with pytest.raises(CallerError, match="not found") as err:
        verify_file(tmp_path / "absent.gguf", manifest)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED


def test_manifest_of_another_model_is_a_clear_error(manifest: Manifest, tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=3)
    with pytest.raises(CallerError, match="another model") as err:
        verify_file(tiny, manifest)
    assert err.value.reason is Reason.ARTIFACT_MISMATCH
    assert "3 layers" in err.value.message and "30 layers" in err.value.message
    # Same shapes and names, other weights: the header matches, every tensor differs.
    a = write_tiny_llama(tmp_path / "a.gguf", seed=1)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=2)
    report = verify_file(b, build_manifest(a))
    assert report.bad_layers == [0, 1, 2, 3] and not report.ok
    # Same model identity, other metadata: named as another build.
    c = write_tiny_llama(tmp_path / "c.gguf", tied=False)
    with pytest.raises(CallerError, match="different GGUF header") as err:
        verify_file(c, build_manifest(a))


def test_tiny_model_layer_range_and_sparse_holes(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4)
    m = build_manifest(path)
    assert verify_file(path, m).ok
    # Zero everything outside header + layers 1:3 (a sparse partial download).
    keep = m.needed_ranges(LayerRange(1, 3))
    data = bytearray(path.read_bytes())
    holey = bytearray(len(data))
    for start, end in keep:
        holey[start:end] = data[start:end]
    part = tmp_path / "part.gguf"
    part.write_bytes(bytes(holey))
    assert verify_file(part, m, LayerRange(1, 3)).ok
    head = verify_file(part, m, LayerRange(0, 2))
    assert head.bad_layers == [0] and "token_embd.weight" in head.bad_tensors


def test_cli_manifest_verify_and_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4)
    out = tmp_path / "tiny.manifest.json"
    assert _cli("artifact", "manifest", str(path), "-o", str(out)) == EXIT_OK
    m = Manifest.load(out)
    assert _cli("artifact", "verify", str(path), "--manifest", str(out)) == EXIT_OK
    assert _cli("artifact", "verify", str(path), "--manifest", str(out), "--layers", "1:3") == EXIT_OK
    t = m.tensor("blk.2.attn_v.weight")
    _flip(path, t.offset + 3)
    capsys.readouterr()
    assert _cli("artifact", "verify", str(path), "--manifest", str(out)) == EXIT_MISMATCH
    captured = capsys.readouterr()
    assert "layer 2: MISMATCH in blk.2.attn_v.weight" in captured.out
    assert "blk.2.attn_v.weight" in captured.err
    assert _cli("artifact", "verify", str(path), "--manifest", str(out), "--layers", "0:2") == EXIT_OK
    assert _cli("artifact", "verify", str(out), "--manifest", str(out)) == EXIT_ERROR
    assert "not a GGUF" in capsys.readouterr().err
