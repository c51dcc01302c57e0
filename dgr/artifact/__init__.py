"""The artifact plane: Model Artifact manifests, verification, possession proofs, transfer.

Transfer lives in `dgr.artifact.torrent` (seed, fetch) and is not re-exported,
so that code which only checks manifests and proofs (the tracker) does not
load libtorrent.
"""

from dgr.artifact.constants import SCHEMA_VERSION, GlobalNeed
from dgr.artifact.build import build_manifest
from dgr.artifact.manifest import Manifest
from dgr.artifact.proof import (
    Answer,
    Challenge,
    ProofResult,
    Verdict,
    answer_challenge,
    check_answer,
    make_challenge,
)
from dgr.artifact.verify import VerifyReport, verify_file
from dgr.gguf_meta import Role

__all__ = [
    "SCHEMA_VERSION",
    "GlobalNeed",
    "Role",
    "Manifest",
    "build_manifest",
    "Answer",
    "Challenge",
    "ProofResult",
    "Verdict",
    "answer_challenge",
    "check_answer",
    "make_challenge",
    "VerifyReport",
    "verify_file",
]
