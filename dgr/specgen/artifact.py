"""Generate the tables of spec/artifact-manifest.md from the code.

The constants, roles and verdicts in the spec are written by this module, so
the document cannot drift from the code: a test compares the block between
the markers in the committed spec with `render_tables()`.
Run `python -m dgr.specgen` to rewrite that block after a change.
"""

from __future__ import annotations

from pathlib import Path

from dgr.artifact.constants import (
    BLOCK_SIZE,
    MANIFEST_KIND,
    TARGET_PIECE_COUNT,
    TORRENT_META_VERSION,
    GlobalNeed,
    PieceSize,
    SchemaVersion,
)
from dgr.artifact.proof import Verdict
from dgr.specgen.blocks import around
from dgr.errors import HTTP_TABLE, Reason
from dgr.gguf_meta import GLOBAL_ROLES, Role

__all__ = ["BEGIN", "END", "SPEC_PATH", "render_tables", "splice"]

BEGIN = "<!-- BEGIN GENERATED: python -m dgr.specgen -->"
END = "<!-- END GENERATED -->"
SPEC_PATH = Path(__file__).resolve().parents[2] / "spec" / "artifact-manifest.md"

_ROLE_DOC = {
    Role.LAYER: "tensor `blk.N.*` of layer N",
    Role.HEAD: "needed by the shard holding layer 0",
    Role.TAIL: "needed by the shard holding the last layer",
    Role.HEAD_TAIL: "needed by both ends (tied token embedding: no `output.weight`)",
    Role.SHARED: "needed by every shard (e.g. `rope_freqs.weight`)",
}
_VERDICT_DOC = {
    Verdict.OK: "the block climbs to the manifest's piece hash",
    Verdict.WRONG_MANIFEST: "challenge or answer names another manifest id",
    Verdict.WRONG_BLOCK: "answer is for another block, or the block lies outside the file",
    Verdict.OUTSIDE_CLAIM: "the block does not overlap the tensors of the claimed layers",
    Verdict.BAD_LENGTH: "block bytes are not 16 KiB (or the file's short last block)",
    Verdict.BAD_PATH: "merkle path has the wrong number of 32-byte hashes",
    Verdict.HASH_MISMATCH: "the path does not climb to the piece hash: the node lacks the bytes",
}


def render_tables() -> str:
    lines = [BEGIN, "", "### Constants", "", "| name | value |", "|---|---|"]
    lines += [
        f"| `kind` | `{MANIFEST_KIND}` |",
        f"| schema versions | {', '.join(str(int(v)) for v in SchemaVersion)} |",
        f"| BLOCK_SIZE (merkle leaf) | {BLOCK_SIZE} |",
        f"| piece length min | {int(PieceSize.MIN)} |",
        f"| piece length max | {int(PieceSize.MAX)} |",
        f"| TARGET_PIECE_COUNT | {TARGET_PIECE_COUNT} |",
        f"| torrent meta version | {TORRENT_META_VERSION} |",
        "",
        "### Tensor roles",
        "",
        "| role | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{r.value}` | {_ROLE_DOC[r]} |" for r in Role]
    lines += ["", "Global tensor name prefixes (before the first `.`; `*` matches any rest); any other global is `shared`:", ""]
    lines += [f"- `{prefix}` -> `{role.value}`" for prefix, role in GLOBAL_ROLES.items()]
    lines += ["", "### Global needs", "", "| need | globals included |", "|---|---|"]
    lines += [
        f"| `{GlobalNeed.COMPUTE.value}` | roles `shared`, plus `head`/`head+tail` if the range starts at 0, "
        "plus `tail`/`head+tail` if it ends at block_count: the globals the layer-range API loads; "
        "the default, what nodes verify and fetch |",
        f"| `{GlobalNeed.LOADER.value}` | every global tensor, whatever the range: what a derived shard GGUF held "
        "before the layer-range API; kept for `--globals loader` |",
    ]
    lines += ["", "### Proof verdicts", "", "| verdict | meaning |", "|---|---|"]
    lines += [f"| `{v.value}` | {_VERDICT_DOC[v]} |" for v in Verdict]
    lines += ["", "### Error reasons", "", "| reason | HTTP | raised when |", "|---|---|---|"]
    for reason, why in (
        (Reason.MODEL_LOAD_FAILED, "missing, non-GGUF, truncated or unparsable file"),
        (Reason.ARTIFACT_MISMATCH, "file of another model/build, tensor mismatch, or an inconsistent manifest"),
        (Reason.PROOF_FAILED, "ProofResult.raise_if_failed() on a failed proof"),
    ):
        lines.append(f"| `{reason.value}` | {HTTP_TABLE[reason][0]} | {why} |")
    lines += ["", END]
    return "\n".join(lines)


def splice(text: str) -> str:
    """text with its generated block replaced by render_tables()."""
    head, tail = around(text, BEGIN, END, "spec")
    return head + render_tables() + tail
