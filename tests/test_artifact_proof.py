"""Layer-possession proofs: honest nodes pass, nodes without the bytes fail, forgeries fail."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from fixtures.artifact_helpers import write_tiny_llama

from dgr.artifact.constants import BLOCK_SIZE
from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest
from dgr.artifact.proof import (
    Answer,
    Challenge,
    Verdict,
    answer_challenge,
    challenge_blocks,
    check_answer,
    make_challenge,
)
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason


def test_honest_node_passes_many_challenges(manifest: Manifest, model_path: Path) -> None:
    rng = random.Random(7)
    claim = LayerRange(10, 20)
    runs = challenge_blocks(manifest, claim)
    seen_pieces = set()
    with model_path.open("rb") as f:
        for _ in range(200):
            c = make_challenge(manifest, claim, rng)
            g = (c.piece * manifest.torrent.piece_length + c.block * BLOCK_SIZE) // BLOCK_SIZE
            assert any(lo <= g < hi for lo, hi in runs)
            # The answer travels as JSON.
            a = Answer.from_json(answer_challenge(f, manifest, Challenge.from_json(c.to_json())).to_json())
            result = check_answer(manifest, c, a)
            assert result.ok, result.message
            result.raise_if_failed()
            seen_pieces.add(c.piece)
    # Draws spread over the range (368 pieces): not one piece over and over.
    assert len(seen_pieces) > 100


def test_node_with_corrupted_range_fails(manifest: Manifest, model_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    shutil.copyfile(model_path, bad)
    claim = LayerRange(12, 13)
    # One flipped byte in every 16 KiB block of layer 12.
    with bad.open("r+b") as f:
        for start, end in manifest.layers[12].ranges:
            for off in range(start, end, BLOCK_SIZE):
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x80]))
    rng = random.Random(3)
    for _ in range(20):
        c = make_challenge(manifest, claim, rng)
        result = check_answer(manifest, c, answer_challenge(bad, manifest, c))
        assert result.verdict is Verdict.HASH_MISMATCH
        with pytest.raises(CallerError) as err:
            result.raise_if_failed()
        assert err.value.reason is Reason.PROOF_FAILED
    # The same node still proves the layers it does hold.
    c = make_challenge(manifest, LayerRange(20, 22), rng)
    assert check_answer(manifest, c, answer_challenge(bad, manifest, c)).ok


def test_node_missing_the_range_fails(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4)
    m = build_manifest(path)
    # A sparse partial file as BitTorrent leaves it: whole pieces covering the
    # header and layers 0:2, zeros elsewhere.
    data = path.read_bytes()
    part = bytearray(len(data))
    for piece in m.needed_pieces(LayerRange(0, 2)):
        start, end = m.piece_span(piece)
        part[start:end] = data[start:end]
    partial = tmp_path / "partial.gguf"
    partial.write_bytes(bytes(part))
    rng = random.Random(11)
    for _ in range(30):
        held = make_challenge(m, LayerRange(0, 2), rng)
        assert check_answer(m, held, answer_challenge(partial, m, held)).ok
    verdicts = set()
    for _ in range(30):
        missing = make_challenge(m, LayerRange(3, 4), rng)
        verdicts.add(check_answer(m, missing, answer_challenge(partial, m, missing)).verdict)
    assert verdicts == {Verdict.HASH_MISMATCH}
    # A file cut before the piece cannot even answer.
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: m.layers[3].ranges[0][0]])
    c = make_challenge(m, LayerRange(3, 4), rng)
    with pytest.raises(CallerError, match="does not hold it") as err:
        answer_challenge(cut, m, c)
    assert err.value.reason is Reason.MODEL_LOAD_FAILED


def test_forged_answers_fail(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layers=4)
    # 64 KiB pieces: 4 blocks per piece, so paths have 2 hashes to forge.
    m = build_manifest(path, piece_length=65536)
    rng = random.Random(5)
    c = make_challenge(m, LayerRange(1, 3), rng)
    good = answer_challenge(path, m, c)
    assert check_answer(m, c, good).ok
    cases = {
        Verdict.HASH_MISMATCH: attrs.evolve(good, data=bytes(len(good.data))),
        Verdict.BAD_LENGTH: attrs.evolve(good, data=good.data[:-1]),
        Verdict.BAD_PATH: attrs.evolve(good, path=good.path[:-1]),
        Verdict.WRONG_BLOCK: attrs.evolve(good, block=good.block ^ 1),
        Verdict.WRONG_MANIFEST: attrs.evolve(good, manifest_id="0" * 64),
    }
    for verdict, answer in cases.items():
        assert check_answer(m, c, answer).verdict is verdict
    # A sibling path that is right for another block does not transfer.
    assert len(good.path) == 2
    c2 = attrs.evolve(c, block=c.block ^ 1)
    other = answer_challenge(path, m, c2)
    assert check_answer(m, c2, other).ok
    assert check_answer(m, c2, attrs.evolve(other, data=good.data)).verdict is Verdict.HASH_MISMATCH
    assert check_answer(m, c, attrs.evolve(good, path=other.path)).verdict is Verdict.HASH_MISMATCH
    # A challenge outside the claim is refused even with the right bytes.
    outside = make_challenge(m, LayerRange(0, 1), rng)
    assert check_answer(
        m, attrs.evolve(outside, layers=LayerRange(3, 4)), answer_challenge(path, m, outside)
    ).verdict is (Verdict.OUTSIDE_CLAIM)


def test_other_manifest_and_bad_claims_are_refused(tmp_path: Path) -> None:
    a = build_manifest(write_tiny_llama(tmp_path / "a.gguf", seed=1))
    b = build_manifest(write_tiny_llama(tmp_path / "b.gguf", seed=2))
    c = make_challenge(a, LayerRange(0, 1), random.Random(0))
    with pytest.raises(CallerError) as err:
        answer_challenge(tmp_path / "b.gguf", b, c)
    assert err.value.reason is Reason.ARTIFACT_MISMATCH
    with pytest.raises(CallerError) as err:
        make_challenge(a, LayerRange(2, 9), random.Random(0))
    assert err.value.reason is Reason.INVALID_REQUEST
    with pytest.raises(CallerError):
        Answer.from_json({"manifest_id": a.id, "piece": 0, "block": 0, "data": "!!", "path": []})


def test_tracker_side_import_does_not_load_libtorrent() -> None:
    """The tracker checks proofs with dgr.artifact alone: no libtorrent, no trio, no GGUF parsing."""
    code = (
        "import sys, dgr.artifact\n"
        "print(sorted(m for m in ('libtorrent', 'trio', 'gguf', 'torch', 'llama_cpp') if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert out.stdout.strip() == "[]"
