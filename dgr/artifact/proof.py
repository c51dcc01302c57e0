"""Layer-possession proofs: a node shows it holds layers [A, B) of a model.

The tracker holds only the manifest. It picks a random 16 KiB block among the
blocks that overlap the tensors of the claimed layers; the node answers with
that block's bytes and the BEP 52 merkle path from the block's leaf hash up
to its piece hash; the tracker climbs the path and compares the result with
the piece hash in the manifest. A node that lacks the block (or holds wrong
bytes) cannot produce a path that climbs to the piece hash without breaking
SHA-256.

One challenge catches a node missing a fraction f of the range with
probability f; k independent challenges catch it with 1 - (1 - f)^k. The
tracker should draw with `random.SystemRandom()` so nodes cannot predict
blocks.

Pure functions over values; answer_challenge alone reads the node's file.
Left out: timing (a node could relay blocks from the swarm; the tracker's
deadline on answers is what makes that costly) and transport (JSON forms are
given by to_json/from_json).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import random
from pathlib import Path
from typing import Any, BinaryIO

import attrs

from dgr.artifact import merkle
from dgr.artifact.constants import BLOCK_SIZE
from dgr.artifact.manifest import Manifest
from dgr.backends.base import LayerRange
from dgr.errors import CallerError, Reason

__all__ = [
    "Challenge",
    "Answer",
    "Verdict",
    "ProofResult",
    "challenge_blocks",
    "make_challenge",
    "answer_challenge",
    "check_answer",
]


@attrs.frozen
class Challenge:
    """Prove you hold block `block` of piece `piece` of the manifest's file."""

    manifest_id: str
    layers: LayerRange  # the claim being tested
    piece: int
    block: int  # index of the 16 KiB block within the piece

    def to_json(self) -> dict[str, Any]:
        return {"manifest_id": self.manifest_id, "layers": str(self.layers), "piece": self.piece, "block": self.block}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Challenge":
        try:
            return cls(
                manifest_id=str(d["manifest_id"]),
                layers=LayerRange.parse(str(d["layers"])),
                piece=int(d["piece"]),
                block=int(d["block"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"malformed challenge: {exc}") from None


@attrs.frozen
class Answer:
    manifest_id: str
    piece: int
    block: int
    data: bytes  # the block's bytes: 16 KiB, or less for the file's last block
    path: tuple[bytes, ...]  # sibling hashes, leaf level first, up to the piece hash

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_id": self.manifest_id,
            "piece": self.piece,
            "block": self.block,
            "data": base64.b64encode(self.data).decode("ascii"),
            "path": [h.hex() for h in self.path],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Answer":
        try:
            path = tuple(bytes.fromhex(h) for h in d["path"])
            if any(len(h) != 32 for h in path):
                raise ValueError("path hashes must be 32 bytes")
            return cls(
                manifest_id=str(d["manifest_id"]),
                piece=int(d["piece"]),
                block=int(d["block"]),
                data=base64.b64decode(d["data"], validate=True),
                path=path,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"malformed proof answer: {exc}") from None


class Verdict(enum.Enum):
    OK = "ok"
    WRONG_MANIFEST = "wrong_manifest"  # answer or challenge names another manifest
    WRONG_BLOCK = "wrong_block"  # answer is for another block, or the block is outside the file
    OUTSIDE_CLAIM = "outside_claim"  # the challenged block does not touch the claimed layers
    BAD_LENGTH = "bad_length"  # block bytes of the wrong length
    BAD_PATH = "bad_path"  # merkle path of the wrong depth
    HASH_MISMATCH = "hash_mismatch"  # does not climb to the manifest's piece hash


@attrs.frozen
class ProofResult:
    verdict: Verdict
    message: str

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK

    def raise_if_failed(self) -> None:
        """Raises CallerError(PROOF_FAILED) unless the proof held."""
        if not self.ok:
            raise CallerError(Reason.PROOF_FAILED, self.message, verdict=self.verdict.value)


def challenge_blocks(manifest: Manifest, layers: LayerRange) -> list[tuple[int, int]]:
    """Global 16 KiB block index runs [first, stop) overlapping the tensors of layers."""
    manifest.check_layers(layers)
    runs: list[tuple[int, int]] = []
    for layer in manifest.layers[layers.start : layers.stop]:
        for start, end in layer.ranges:
            lo, hi = start // BLOCK_SIZE, (end - 1) // BLOCK_SIZE + 1
            if runs and lo <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(hi, runs[-1][1]))
            else:
                runs.append((lo, hi))
    return runs


def _block_offset(manifest: Manifest, piece: int, block: int) -> int:
    return piece * manifest.torrent.piece_length + block * BLOCK_SIZE


def make_challenge(manifest: Manifest, layers: LayerRange, rng: random.Random) -> Challenge:
    """A uniformly random block among those overlapping the claimed layers' tensors.

    Raises:
        CallerError(INVALID_REQUEST): layers outside the model, or without tensors.
    """
    runs = challenge_blocks(manifest, layers)
    total = sum(hi - lo for lo, hi in runs)
    if total == 0:
        raise CallerError(Reason.INVALID_REQUEST, f"layers {layers} hold no tensor bytes to challenge")
    k = rng.randrange(total)
    for lo, hi in runs:
        if k < hi - lo:
            g = lo + k
            break
        k -= hi - lo
    per_piece = manifest.torrent.piece_length // BLOCK_SIZE
    return Challenge(manifest_id=manifest.id, layers=layers, piece=g // per_piece, block=g % per_piece)


def answer_challenge(file: str | Path | BinaryIO, manifest: Manifest, challenge: Challenge) -> Answer:
    """Read the challenged piece from the node's file and answer with the block and its path.

    Holes in a sparse file read as zeros and give an answer that fails the check.

    Raises:
        CallerError(ARTIFACT_MISMATCH): the challenge is for another manifest.
        CallerError(MODEL_LOAD_FAILED): the file ends before the challenged piece does.
    """
    if challenge.manifest_id != manifest.id:
        raise CallerError(
            Reason.ARTIFACT_MISMATCH,
            f"challenge is for manifest {challenge.manifest_id[:12]}, this node holds {manifest.id[:12]}",
        )
    if not 0 <= challenge.piece < manifest.torrent.piece_count:
        raise CallerError(Reason.INVALID_REQUEST, f"piece {challenge.piece} is outside the file")
    start, end = manifest.piece_span(challenge.piece)
    if isinstance(file, (str, Path)):
        with open(file, "rb") as f:
            f.seek(start)
            piece = f.read(end - start)
    else:
        file.seek(start)
        piece = file.read(end - start)
    if len(piece) != end - start:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"the file ends inside piece {challenge.piece} (bytes [{start}, {end})): this node does not hold it",
        )
    leaves = merkle.block_hashes(piece)
    if not 0 <= challenge.block < len(leaves):
        raise CallerError(Reason.INVALID_REQUEST, f"block {challenge.block} is outside piece {challenge.piece}")
    width = merkle.leaves_per_piece(manifest.file.size, manifest.torrent.piece_length)
    lo = challenge.block * BLOCK_SIZE
    return Answer(
        manifest_id=manifest.id,
        piece=challenge.piece,
        block=challenge.block,
        data=piece[lo : lo + BLOCK_SIZE],
        path=tuple(merkle.proof_path(leaves, challenge.block, width)),
    )


def check_answer(manifest: Manifest, challenge: Challenge, answer: Answer) -> ProofResult:
    """Check an answer against the manifest's piece hashes alone. Never raises on bad answers."""
    if challenge.manifest_id != manifest.id or answer.manifest_id != manifest.id:
        return ProofResult(Verdict.WRONG_MANIFEST, f"proof is not for manifest {manifest.id[:12]}")
    if (answer.piece, answer.block) != (challenge.piece, challenge.block):
        return ProofResult(
            Verdict.WRONG_BLOCK,
            f"answered piece {answer.piece} block {answer.block}, "
            f"challenged piece {challenge.piece} block {challenge.block}",
        )
    plen = manifest.torrent.piece_length
    offset = _block_offset(manifest, challenge.piece, challenge.block)
    if not (0 <= challenge.piece < manifest.torrent.piece_count and 0 <= challenge.block < plen // BLOCK_SIZE) or (
        offset >= manifest.file.size
    ):
        return ProofResult(Verdict.WRONG_BLOCK, f"piece {challenge.piece} block {challenge.block} is outside the file")
    g = offset // BLOCK_SIZE
    if not any(lo <= g < hi for lo, hi in challenge_blocks(manifest, challenge.layers)):
        return ProofResult(Verdict.OUTSIDE_CLAIM, f"block at byte {offset} is not in layers {challenge.layers}")
    want_len = min(BLOCK_SIZE, manifest.file.size - offset)
    if len(answer.data) != want_len:
        return ProofResult(Verdict.BAD_LENGTH, f"block has {len(answer.data)} bytes, expected {want_len}")
    depth = merkle.leaves_per_piece(manifest.file.size, plen).bit_length() - 1
    if len(answer.path) != depth or any(len(h) != 32 for h in answer.path):
        return ProofResult(Verdict.BAD_PATH, f"merkle path has {len(answer.path)} hashes, expected {depth}")
    top = merkle.root_from_path(hashlib.sha256(answer.data).digest(), challenge.block, answer.path)
    if top.hex() != manifest.torrent.piece_hashes[challenge.piece]:
        return ProofResult(
            Verdict.HASH_MISMATCH,
            f"block {challenge.block} of piece {challenge.piece} (layers {challenge.layers}) "
            "does not match the manifest",
        )
    return ProofResult(
        Verdict.OK, f"holds piece {challenge.piece} block {challenge.block} of layers {challenge.layers}"
    )
