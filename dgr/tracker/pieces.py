"""What the tracker knows of each model's tokens: every token id's bytes, to check the tail's answers by.

A route's tail answers each step with a token id and that token's bytes
(dgr.seam.frame `TokenResult`), and the client reads the bytes. The tracker
holds the vocabulary of the models it serves, by weight digest, so that it
takes no bytes on the tail's word: an answer whose bytes, or whose end of
generation, are not its token id's is a forged frame (`Pieces.forged`), and
dgr.tracker.deliveries refuses it and fails the session naming the tail.

Where a vocabulary comes from:
- the stub models' (dgr.backends.stub): the stub's vocabulary is code, so
  every tracker knows it for the stub models `dgr up` and `dgr node` serve
  (`builtin`), and a test may add its own stub spec's (`stub_pieces`);
- a GGUF file the operator names (`dgr tracker --vocab FILE`, which `dgr up`
  passes its model as): only its vocabulary is loaded (dgr.backends.gguf_text,
  the same bytes an honest tail's backend gives), under the file's sha256,
  the digest its nodes register (`add_gguf`).

Rules: a vocabulary is keyed by the file's own digest, never by what a node
registers about it (a name, an architecture), so a member cannot choose
which table its answers are checked against. Pure but for `add_gguf`, which
reads the file.

Left out: a model the tracker has no vocabulary for. Its answers are checked
only against the vocabulary size the route's nodes registered, and their
bytes are the tail's (the tracker logs this once per model, and
spec/security.md says so): give the tracker `--vocab` for every GGUF it
serves. Fetching the vocabulary from the model's artifact (the GGUF header's
pieces, checked against the manifest) is not done.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from dgr.backends.base import LayerRange, Vocabulary
from dgr.backends.stub import DEEPSEEK_LIKE, STUB_VOCAB, StubBackend, StubSpec
from dgr.seam.frame import TokenResult

__all__ = ["Pieces", "Vocabularies", "stub_pieces"]


@attrs.frozen(eq=False)
class Pieces:
    """One model's token bytes by id, and the ids that end generation."""

    table: tuple[bytes, ...]
    eog: frozenset[int]

    @classmethod
    def of(cls, vocab: Vocabulary, size: int) -> Pieces:
        """Every id below `size` as `vocab` gives it: the bytes and the end of generation an honest tail sends."""
        return cls(tuple(vocab.token_bytes(t) for t in range(size)),
                   frozenset(t for t in range(size) if vocab.is_eog(t)))

    def forged(self, token: TokenResult) -> str | None:
        """What of `token` is not its id's, in the tracker's words (never the bytes it carries); None if nothing."""
        if not 0 <= token.token < len(self.table):
            return f"token id {token.token} is outside the vocabulary of {len(self.table)}"
        if token.piece != self.table[token.token]:
            return f"its {len(token.piece)} bytes of text are not token {token.token}'s"
        if token.eog != (token.token in self.eog):
            return f"its end of generation ({token.eog}) is not token {token.token}'s"
        return None


def stub_pieces(spec: StubSpec = StubSpec()) -> tuple[str, Pieces]:
    """(digest, vocabulary) of the stub model `spec`: every stub model has the stub's vocabulary."""
    backend = StubBackend(spec=spec, layers=LayerRange(0, 1))  # one layer: its text is the whole model's
    return spec.info().digest, Pieces.of(backend, len(STUB_VOCAB))


@attrs.define
class Vocabularies:
    """The vocabularies the tracker checks answers against, by model digest (`builtin`: the stub models')."""

    by_digest: dict[str, Pieces] = attrs.field(factory=dict)

    @classmethod
    def builtin(cls) -> Vocabularies:
        return cls(dict(stub_pieces(spec) for spec in (StubSpec(), DEEPSEEK_LIKE)))

    def add(self, digest: str, pieces: Pieces) -> None:
        self.by_digest[digest] = pieces

    def add_gguf(self, path: str | Path) -> str:
        """Load the vocabulary of the GGUF at `path` under the file's sha256; returns that digest.

        Raises: CallerError(MODEL_LOAD_FAILED): missing, unreadable or not a usable GGUF.
        """
        from dgr.backends.gguf_text import GgufText  # libllama: only a tracker given --vocab loads it
        from dgr.digest import file_sha256

        digest = file_sha256(path)
        text = GgufText.load(path)
        try:
            self.add(digest, Pieces.of(text, text.n_vocab))
        finally:
            text.close()
        return digest
