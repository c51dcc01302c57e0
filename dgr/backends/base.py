"""The contract every shard backend meets, in three parts a caller can take apart.

- `Compute`: layers [start, stop) of a model over explicit positions, with per-session KV
  (open, close, forward, forward_batch, what is held).
- `PrefixSlots`: KV prefixes kept past their session in sequence slots (keep, reopen from, trim,
  drop, export and import as bytes).
- `Vocabulary`: tokenize and the chat template at the head; token bytes and end of generation at the tail.
- `ShardBackend` is all three: what a node loads. A caller depends on the narrowest part it uses.

A backend computes layers [start, stop) of one model for many Route Sessions
at once, each with its own Hot KV State. It is synchronous and blocking: the
node's step scheduler (dgr.node.scheduler) makes every call, one at a time,
from one thread (or, for short decodes of a one-thread backend, from the
loop), so a backend never sees two calls at once.

Shapes at the boundary (W = ModelInfo.seam_width):
- head shard (start == 0): token ids in, int32 [n]
- other shards: hidden states in, float32 [n, W]
- non-tail shards (stop < n_layers): hidden states out, float32 [n, W]
- tail shard: logits out for the last position only, float32 [vocab]

Positions are always passed in. `forward(sid, pos0, ...)` must be called with
pos0 equal to the number of positions already in that session's KV; the node
session FSM enforces it, the backend checks it again and raises.

Batching: `forward_batch` takes the steps of several sessions (at most one
each) and computes them in one call where the backend can (llama.cpp: one
`llama_decode` over several sequence ids). The default runs them one by
one. Either way each step's answer equals what `forward` alone would give.

Left out: sampling (dgr.sampling does it, the same for every backend) and
transport (dgr.seam).
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import attrs
import numpy as np
import outcome

from dgr.errors import CallerError, DgrError, Reason
from dgr.seam.types import DeviceMemory, ModelInfo

__all__ = ["LayerRange", "Compute", "PrefixSlots", "Vocabulary", "ShardBackend", "ChatMessage", "Step",
           "COMPUTE_ERRORS", "layers_arg", "forward_by_rows"]

# What a failed step may raise: typed errors, and what numpy, ctypes or torch raise on bad input.
COMPUTE_ERRORS = (DgrError, ValueError, RuntimeError, IndexError, OSError)

ChatMessage = dict[str, Any]


@attrs.frozen
class LayerRange:
    """Contiguous transformer layers [start, stop)."""

    start: int
    stop: int

    def __attrs_post_init__(self) -> None:
        if not (0 <= self.start < self.stop):
            raise ValueError(f"bad layer range {self.start}:{self.stop}")

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        """Parse 'A:B'."""
        a, sep, b = text.partition(":")
        if not sep:
            raise ValueError(f"layer range must look like A:B, got {text!r}")
        return cls(int(a), int(b))

    def __str__(self) -> str:
        return f"{self.start}:{self.stop}"

    def __len__(self) -> int:
        return self.stop - self.start


@attrs.frozen(eq=False)
class Step:
    """One session's positions [pos0, pos0 + n) for this shard: the arguments of `forward`."""

    sid: str
    pos0: int
    token_ids: np.ndarray | None  # int32 [n]   (head, or needs_token_ids)
    hidden: np.ndarray | None  # float32 [n, W] (non-head)
    want_logits: int  # the tail: logits of the last `want_logits` positions (0: none; True is 1)
    decode: bool = False  # a decode step (its last accepted token, and any drafts): batched first
    # compute the positions one at a time, each on the kernels a one-position step uses, so a speculative
    # step's rows round exactly as decoding without speculation does (`--spec-exact`)
    one_row: bool = False

    @property
    def n_tokens(self) -> int:
        if self.hidden is not None:
            return int(self.hidden.shape[0])
        return int(np.size(self.token_ids))


class Compute(abc.ABC):
    """Layers [layers.start, layers.stop) of a model, computed over explicit positions, with per-session KV."""

    info: ModelInfo
    layers: LayerRange
    name: str  # backend name: stub, torch, llama, llama_shard
    n_threads: int = 1  # threads one backend call computes with (llama.cpp's and torch's own pools)

    @property
    def is_head(self) -> bool:
        return self.layers.start == 0

    @property
    def is_tail(self) -> bool:
        return self.layers.stop == self.info.n_layers

    # -- sessions -----------------------------------------------------------
    @abc.abstractmethod
    def open_session(self, sid: str, max_positions: int, lane: int | None = None) -> None:
        """Reserve Hot KV State for up to max_positions positions.

        `lane`: the numbered slot to give the session if it is free, for a backend that has them
        (llama.cpp's sequence ids: dgr.fsm.phases says why); the others ignore it.

        Raises: CallerError(SESSION_EXISTS | CONTEXT_LENGTH_EXCEEDED | NODE_AT_CAPACITY), as dgr.sessions decides.
        """

    @abc.abstractmethod
    def close_session(self, sid: str) -> None:
        """Free the session's KV. Idempotent."""

    @abc.abstractmethod
    def forward(
        self,
        sid: str,
        pos0: int,
        token_ids: np.ndarray | None,  # int32 [n]   (head, or needs_token_ids)
        hidden: np.ndarray | None,  # float32 [n, W] (non-head)
        want_logits: int,  # tail: logits of the last this many positions (0 or False: none; True: 1)
    ) -> np.ndarray | None:
        """Run positions [pos0, pos0 + n) through this shard, appending to KV.

        Returns float32 [n, W] on a non-tail shard; on the tail float32 [vocab] for the last position
        when want_logits is 1 (or True), float32 [want_logits, vocab] for the last rows of a
        speculative step (each row predicts the token after its position), else None.
        """

    def forward_batch(self, steps: Sequence[Step]) -> list[outcome.Outcome]:
        """Compute several sessions' steps (one each); each answer as `forward` gives it, or its error.

        The default runs them one by one; a backend that can do better in one call overrides it.
        """
        out: list[outcome.Outcome] = []
        for s in steps:
            try:
                if s.one_row and s.n_tokens > 1:
                    out.append(outcome.Value(forward_by_rows(self, s)))
                else:
                    out.append(outcome.Value(self.forward(s.sid, s.pos0, s.token_ids, s.hidden, s.want_logits)))
            except COMPUTE_ERRORS as exc:
                out.append(outcome.Error(exc))
        return out

    def rename_session(self, sid: str, new: str) -> None:
        """Hold `sid`'s KV, slot and counters under `new` from now on: a repair resumes a session under a
        fresh id (a node opens each id once), computing nothing.

        Raises: CallerError(UNKNOWN_SESSION | SESSION_EXISTS), as dgr.sessions `SessionTable.rename` decides;
        CallerError(INVALID_REQUEST) from a backend that cannot (the repair then computes every position again).
        """
        raise CallerError(Reason.INVALID_REQUEST, f"the {self.name} backend cannot move a session to another id")

    @abc.abstractmethod
    def positions_computed(self, sid: str) -> int:
        """How many positions this shard evaluated for the session (never recomputed)."""

    @abc.abstractmethod
    def kv_bytes(self) -> int:
        """Bytes of Hot KV State held now, over all sessions."""

    def session_count(self) -> int:
        return 0

    def max_sessions(self) -> int:
        """How many sessions fit in KV memory at once."""
        return 16

    def max_positions(self) -> int:
        """Positions one session may hold here (`--ctx`); the node advertises it and the gateway clamps to it."""
        return self.info.context_length

    def close(self) -> None:
        """Release the model. Called once when the node stops."""

    def describe(self) -> dict[str, Any]:
        """Backend metadata for /v1/models and node status."""
        return {"backend": self.name, "layers": str(self.layers)}

    def device_memory(self) -> list[DeviceMemory]:
        """The accelerators holding this shard's layers, with their memory as of now; empty on the CPU.

        A backend call like any other (the node's scheduler makes it), read again every few seconds for the
        node's status, heartbeats and /metrics, so it must be cheap: a driver query, no allocation.
        """
        return []


class PrefixSlots(abc.ABC):
    """KV prefixes kept past their session, in sequence slots: kept, reopened from, dropped, written out.

    The node's dgr.node.prefix decides what to keep; the backend holds the KV. A backend that keeps
    nothing leaves `prefix_capable` False and the methods unimplemented.
    """

    prefix_capable: bool = False  # True where the methods below work

    def keep_prefix(self, sid: str, key: str, positions: int) -> int:
        """End `sid` but keep its first `positions` positions of KV under `key`; return the bytes kept.

        Its sequence slot stays taken until `drop_prefix(key)` or `open_from_prefix(..., take=True)`.
        Any number of positions (dgr.node.prefix reuses to the token).

        Raises: CallerError(INVALID_REQUEST): the memory cannot drop the positions after them (recurrent,
        SWA, DeepSeek-V4); the session stays open.
        """
        raise NotImplementedError

    def open_from_prefix(self, sid: str, max_positions: int, key: str, positions: int, take: bool,
                         lane: int | None = None) -> None:
        """Open `sid` holding a copy of the first `positions` positions of `key`'s KV (in `lane`'s slot
        if it is free, as `open_session`).

        With `take`, the kept KV itself becomes the session's and `key` is gone (no copy, no new slot).

        Raises: CallerError(INVALID_REQUEST): the memory cannot drop the kept positions past `positions`.
        """
        raise NotImplementedError

    def drop_prefix(self, key: str) -> None:
        """Free a kept prefix's KV and slot. Idempotent."""
        raise NotImplementedError

    def trim_session(self, sid: str, positions: int) -> None:
        """Keep only the first `positions` positions of `sid`'s KV (any number, where the memory can drop them)."""
        raise NotImplementedError

    def free_slots(self) -> int:
        """Sessions that can open now without dropping a kept prefix."""
        raise NotImplementedError

    def prefix_bytes(self) -> int:
        """KV bytes held by kept prefixes (not counted in `kv_bytes`, which is live sessions' only)."""
        return 0

    snapshot_capable: bool = False  # True where the two methods below work (dgr.node.snapshot)

    def export_prefix(self, key: str) -> bytes:
        """A kept prefix's KV as bytes that `import_prefix` of the same model file and layers takes back."""
        raise NotImplementedError

    def import_prefix(self, key: str, data: bytes, positions: int) -> int:
        """Hold `data` (from `export_prefix`) as the kept prefix `key` in a free slot; return its bytes.

        Raises:
            CallerError(NODE_AT_CAPACITY): no free slot. CallerError(SNAPSHOT_MISMATCH): the bytes do not load.
        """
        raise NotImplementedError


class Vocabulary(abc.ABC):
    """Text in (tokenize, chat template) at the head, token bytes and end of generation out at the tail."""

    # True where `tokenize`, `tokenize_chat` and `render_chat` touch nothing the compute touches (a
    # vocabulary loaded apart, pure Python): the node then runs them off its backend thread, one at a
    # time, so a prompt is tokenized while a prefill chunk computes (dgr.node.service, `tokenize`).
    text_apart: bool = False

    @abc.abstractmethod
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of `text`; with `parse_special`, control-token markup becomes control tokens."""

    @abc.abstractmethod
    def render_chat(self, messages: list[ChatMessage]) -> str:
        """The chat template applied to `messages`, with the assistant's turn opened."""

    def tokenize_chat(self, messages: list[ChatMessage]) -> tuple[list[int], str]:
        """Token ids and prompt text of `messages`; no message content may produce a control token.

        This default parses no control tokens at all, which is safe for a
        vocabulary without them (the stub's); GGUF vocabularies keep the template's
        own control tokens (dgr.backends.gguf_text.GgufText.tokenize_chat).
        """
        text = self.render_chat(messages)
        return self.tokenize(text, add_special=True, parse_special=False), text

    @abc.abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """A token's raw piece bytes (one UTF-8 character may span several tokens)."""

    @abc.abstractmethod
    def is_eog(self, token: int) -> bool:
        """Whether `token` ends generation."""


class ShardBackend(Compute, PrefixSlots, Vocabulary):
    """What a node serves: its layers' compute, the prefix slots beside their KV, and the model's vocabulary.

    Every backend (stub, torch, llama, llama_shard) is one; a caller that needs only one part takes
    that part's type (the scheduler takes a `Compute`, the node's text path a `Vocabulary`).
    """

    def free_slots(self) -> int:
        """Sessions that can open now without dropping a kept prefix (none kept here by default)."""
        return self.max_sessions() - self.session_count()


def layers_arg(text: str) -> LayerRange:
    """argparse type of an A:B layer range: a bad one is a usage error (exit 2), not a traceback."""
    import argparse

    try:
        return LayerRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def forward_by_rows(backend: Compute, s: Step) -> np.ndarray | None:
    """`s` as one one-position forward per position: what `forward` returns for the whole step, each row
    computed on the kernels a one-position decode uses (llama.cpp rounds a multi-row batch differently).

    Returns float32 [n, W] on a non-tail shard; on the tail the logits of the last `want_logits` rows
    ([vocab] for one, [rows, vocab] for more), else None.
    """
    rows, n = int(s.want_logits), s.n_tokens
    outs = []
    for i in range(n):
        want = 1 if rows and i >= n - rows else 0
        outs.append(backend.forward(s.sid, s.pos0 + i, None if s.token_ids is None else s.token_ids[i : i + 1],
                                    None if s.hidden is None else s.hidden[i : i + 1], want))
    if not backend.is_tail:
        return np.concatenate(outs)  # float32 [n, W]
    logits = [o for o in outs if o is not None]  # float32 [vocab] each
    if not logits:
        return None
    return logits[0] if len(logits) == 1 else np.stack(logits)
