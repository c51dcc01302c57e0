"""Manifests: content, stable ids, self-checks, and agreement with libtorrent's hashes."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import gguf
import libtorrent as lt
import pytest
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact import merkle
from dgr.artifact.constants import BLOCK_SIZE, PieceSize
from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest, canonical_json, choose_piece_length, layer_digest
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import Role
from dgr.specgen.artifact import SPEC_PATH, render_tables, splice


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4)


def test_default_model_manifest_content(manifest: Manifest, model_path: Path) -> None:
    m = manifest
    assert m.schema == 1
    assert (m.model.architecture, m.model.block_count, m.model.hidden_size, m.model.seam_width) == (
        "llama",
        30,
        576,
        576,
    )
    assert m.model.vocab_size == 49152 and m.model.context_length == 8192
    assert m.file.name == model_path.name and m.file.size == model_path.stat().st_size
    assert m.file.sha256 == hashlib.sha256(model_path.read_bytes()).hexdigest()

    reader = gguf.GGUFReader(model_path)
    assert m.header.length == reader.data_offset
    assert m.header.tensor_count == len(reader.tensors) == len(m.tensors)
    data = model_path.read_bytes()
    assert m.header.sha256 == hashlib.sha256(data[: reader.data_offset]).hexdigest()
    by_name = {t.name: t for t in reader.tensors}
    for e in m.tensors:
        t = by_name[e.name]
        assert (e.offset, e.size, e.type) == (int(t.data_offset), int(t.n_bytes), t.tensor_type.name)
        assert e.sha256 == hashlib.sha256(data[e.offset : e.end]).hexdigest()
    # SmolLM2 ties its embeddings: token_embd serves both ends, there is no output.weight.
    roles = {e.name: e.role for e in m.tensors if e.layer is None}
    assert roles == {"token_embd.weight": Role.HEAD_TAIL, "output_norm.weight": Role.TAIL}
    assert [layer.index for layer in m.layers] == list(range(30))
    l7 = m.layers[7]
    assert len(l7.tensors) == 9 and all(n.startswith("blk.7.") for n in l7.tensors)
    assert l7.sha256 == layer_digest((n, m.tensor(n).sha256) for n in l7.tensors)
    # 98 MB / 2048 target pieces -> 64 KiB pieces.
    assert m.torrent.piece_length == 65536 and m.torrent.piece_count == -(-m.file.size // 65536)


def test_layer_digest_definition() -> None:
    d1, d2 = "11" * 32, "22" * 32
    want = hashlib.sha256(b"a\x00" + bytes.fromhex(d1) + b"b\x00" + bytes.fromhex(d2)).hexdigest()
    assert layer_digest([("b", d2), ("a", d1)]) == want


def test_needed_pieces_cover_header_and_layers(manifest: Manifest) -> None:
    p = manifest.torrent.piece_length
    got = set(manifest.needed_pieces(LayerRange(10, 20)))
    want = set(range(0, (manifest.header.length - 1) // p + 1))
    for t in manifest.tensors:
        if t.layer is not None and 10 <= t.layer < 20:
            want |= set(range(t.offset // p, (t.end - 1) // p + 1))
    assert got == want
    # The head range also needs the tied embedding; a middle range does not.
    emb = manifest.tensor("token_embd.weight")
    assert emb.offset // p in manifest.needed_pieces(LayerRange(0, 5))
    assert emb.offset // p + 1 not in got


def test_id_is_stable_across_builds(tiny: Path) -> None:
    a, b = build_manifest(tiny), build_manifest(tiny)
    assert a.id == b.id == a.compute_id()
    assert a.id == hashlib.sha256(canonical_json({k: v for k, v in a.to_json().items() if k != "id"})).hexdigest()
    # Layout of the saved JSON does not matter, only content.
    assert Manifest.loads(json.dumps(a.to_json())).id == a.id


def _leaf_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _leaf_paths(v, prefix + (k,))]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _leaf_paths(v, prefix + (i,))]
    return [prefix]


def _mutated(value: Any) -> Any:
    if value is None:
        return 0
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value[:-1] + ("0" if value[-1:] != "0" else "1") if value else "x"
    raise TypeError(value)


def test_id_changes_when_any_field_changes(tiny: Path) -> None:
    m = build_manifest(tiny)
    body = m.to_json()
    del body["id"]
    paths = _leaf_paths(body)
    assert len(paths) > 300  # every tensor, layer and piece field is visited
    for path in paths:
        changed = copy.deepcopy(body)
        node = changed
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = _mutated(node[path[-1]])
        assert hashlib.sha256(canonical_json(changed)).hexdigest() != m.id, path
        # Loading it with the old id is refused.
        changed["id"] = m.id
        with pytest.raises(CallerError) as err:
            Manifest.from_json(changed)
        assert err.value.reason is Reason.ARTIFACT_MISMATCH, path


def test_load_refuses_unknown_schema_and_kind(tiny: Path, tmp_path: Path) -> None:
    m = build_manifest(tiny)
    for key, value in (("schema", 99), ("kind", "something-else")):
        data = m.to_json()
        data[key] = value
        with pytest.raises(CallerError, match=key if key == "kind" else "schema version 99"):
            Manifest.from_json(data)
    out = tmp_path / "m.json"
    m.save(out)
    assert Manifest.load(out) == m
    with pytest.raises(CallerError) as err:
        Manifest.load(tmp_path / "missing.json")
    assert err.value.reason is Reason.NOT_FOUND


def _libtorrent_v2(path: Path, piece_length: int) -> dict:
    ct = lt.create_torrent(lt.list_files(str(path)), piece_length, lt.create_torrent.v2_only)
    ct.set_creation_date(0)
    lt.set_piece_hashes(ct, str(path.parent))
    raw = lt.bencode(ct.generate())
    return {"raw": raw, "dict": lt.bdecode(raw), "ti": lt.torrent_info(raw)}


@pytest.mark.parametrize("n_layers,piece_length", [(4, None), (3, 65536), (1, 1 << 20)])
def test_v2_hashes_match_libtorrent_on_tiny_files(tmp_path: Path, n_layers: int, piece_length: int | None) -> None:
    path = write_tiny_llama(tmp_path / f"t{n_layers}.gguf", n_layers=n_layers, tied=n_layers != 3)
    m = build_manifest(path, piece_length=piece_length)
    lib = _libtorrent_v2(path, m.torrent.piece_length)
    assert str(lib["ti"].info_hashes().v2) == m.torrent.info_hash_v2
    assert lib["dict"][b"info"] == lt.bdecode(lt.bencode(m.info_dict()))
    root = bytes.fromhex(m.torrent.pieces_root)
    if m.file.size > m.torrent.piece_length:
        assert lib["dict"][b"piece layers"][root] == b"".join(bytes.fromhex(h) for h in m.torrent.piece_hashes)
    else:
        # One-piece file (the 1 MiB case): no piece layer, the root is the only hash.
        assert lib["dict"][b"piece layers"] == {} and m.torrent.piece_hashes == (m.torrent.pieces_root,)
    # The torrent built from the manifest alone is one libtorrent accepts with the same hash.
    assert str(lt.torrent_info(m.torrent_bytes()).info_hashes().v2) == m.torrent.info_hash_v2


def test_v2_info_hash_matches_libtorrent_on_default_model(manifest: Manifest, model_path: Path) -> None:
    lib = _libtorrent_v2(model_path, manifest.torrent.piece_length)
    assert str(lib["ti"].info_hashes().v2) == manifest.torrent.info_hash_v2
    root = lib["ti"].files().root(0).to_bytes()
    assert root.hex() == manifest.torrent.pieces_root
    layer = lib["dict"][b"piece layers"][root]
    assert [layer[i : i + 32].hex() for i in range(0, len(layer), 32)] == list(manifest.torrent.piece_hashes)


def test_piece_length_choice() -> None:
    assert choose_piece_length(1000) == PieceSize.MIN
    assert choose_piece_length(98_362_432) == 65536
    assert choose_piece_length(700 * 10**9) == PieceSize.MAX
    for size in (10**5, 10**8, 10**10):
        n = choose_piece_length(size)
        assert n % BLOCK_SIZE == 0 and n & (n - 1) == 0


def test_merkle_padding_rules() -> None:
    # Two blocks in a 4-leaf piece: padded with zero leaves.
    a, b = b"a" * BLOCK_SIZE, b"b" * 100
    la, lb = hashlib.sha256(a).digest(), hashlib.sha256(b).digest()
    z = b"\x00" * 32
    want = hashlib.sha256(hashlib.sha256(la + lb).digest() + hashlib.sha256(z + z).digest()).digest()
    assert merkle.subtree_root([la, lb], 4) == want
    path = merkle.proof_path([la, lb], 1, 4)
    assert merkle.root_from_path(lb, 1, path) == want


def test_not_gguf_and_truncated_are_clear(tmp_path: Path, model_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(CallerError, match="not a GGUF") as err:
        build_manifest(junk)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED
    cut = tmp_path / "cut.gguf"
    with model_path.open("rb") as f:
        cut.write_bytes(f.read(50_000_000))
    with pytest.raises(CallerError, match="truncated") as err:
        build_manifest(cut)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED


def test_spec_tables_match_code() -> None:
    text = SPEC_PATH.read_text(encoding="utf-8")
    assert render_tables() in text
    assert splice(text) == text
    # Every field of the encoding is documented.
    for key in ("kind", "schema", "model", "file", "header", "tensors", "layers", "torrent", "id"):
        assert f"`{key}`" in text


@pytest.mark.parametrize("name", ["../evil.gguf", "/etc/passwd", "a/b.gguf", "..", ".", "", "a\\b.gguf",
                                  "C:evil.gguf", "x\x00.gguf", "~/.bashrc/x"])
def test_file_name_must_be_a_plain_file_name(tiny: Path, name: str) -> None:
    """`--fetch` writes to MODEL_DIR / file.name: a manifest may not name a path."""
    data = build_manifest(tiny).to_json()
    data["file"]["name"] = name
    with pytest.raises(CallerError) as err:
        Manifest.from_json(data)
    assert err.value.reason is Reason.ARTIFACT_MISMATCH and "file name" in err.value.message
