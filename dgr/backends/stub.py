"""The stub backend: a deterministic fake model with real cache semantics.

It has no weights worth the name, but it behaves like a transformer where it
matters to the runtime:
- each layer appends one KV entry per position to the session's state;
- each position's output depends on every earlier position through that
  state (a running sum), and on its own position (a RoPE-like phase), so a
  missing, repeated, reordered or recomputed position changes the answer;
- the same positions give bit-identical outputs however the prompt is cut
  into chunks and however the layers are cut into shards (only elementwise
  ops and sequential `cumsum`; the tail's one matmul always sees one row);
- it counts positions computed per session (tests prove decode never recomputes);
- a session or kept prefix can be cut to any number of positions, as
  llama.cpp's memory can: it keeps its state at every whole block and each
  position's input, and recomputes the positions past the block before the
  cut (bit-identical, since chunking does not change a result);
- `delay_s` per position makes it slow on purpose for telemetry and fault
  tests; `devices`: a fake accelerator's memory for a GPU node's reports;
- a batch's one-position steps are one array op per layer (`forward_rows`),
  bit-identical to one by one: per-session numpy calls were most of a node's.

`StubSpec` describes the fake model. Its seam width may differ from its hidden
size, and it may need token ids beside its first `hash_layers` layers (DeepSeek-V4).
"""

from __future__ import annotations

import hashlib
import io
import time
from typing import Any, Sequence

import attrs
import numpy as np
import outcome

from dgr.backends.base import COMPUTE_ERRORS, ChatMessage, LayerRange, ShardBackend, Step
from dgr.errors import CallerError, Reason
from dgr.seam.types import DeviceMemory, ModelInfo
from dgr.seam.wire import BLOCK_TOKENS
from dgr.sessions import SessionTable

__all__ = ["StubSpec", "StubBackend", "STUB_VOCAB", "DEEPSEEK_LIKE"]

# id 0 is end-of-generation; then printable ASCII and newline.
STUB_VOCAB: tuple[str, ...] = ("</s>",) + tuple(chr(c) for c in range(32, 127)) + ("\n",)
_EOS = 0
_ID = {s: i for i, s in enumerate(STUB_VOCAB)}


def _softsign(x: np.ndarray) -> np.ndarray:
    # only correctly rounded ops (+, *, /, abs): numpy's SIMD tanh/sin may round an
    # element differently depending on the array's length, which would make
    # results depend on chunking
    return x / (1.0 + np.abs(x))


@attrs.frozen
class StubSpec:
    name: str = "stub"
    n_layers: int = 30
    hidden_size: int = 576
    seam_mult: int = 1  # seam width = seam_mult x hidden_size (DeepSeek-V4: 4)
    hash_layers: int = 0  # first layers that also read token ids (DeepSeek-V4: 3)
    context_length: int = 8192
    seed: int = 1234

    @property
    def seam_width(self) -> int:
        return self.seam_mult * self.hidden_size

    def info(self) -> ModelInfo:
        digest = hashlib.sha256(repr(attrs.astuple(self)).encode()).hexdigest()
        return ModelInfo(
            name=self.name,
            architecture="stub",
            n_layers=self.n_layers,
            hidden_size=self.hidden_size,
            seam_width=self.seam_width,
            vocab_size=len(STUB_VOCAB),
            context_length=self.context_length,
            digest=digest,
            needs_token_ids=self.hash_layers > 0,
        )


DEEPSEEK_LIKE = StubSpec(name="stub-dsv4", n_layers=8, hidden_size=64, seam_mult=4, hash_layers=3)


@attrs.define
class _Session:
    max_positions: int
    kv_sum: np.ndarray  # float32 [n_local_layers, W]: running sum of KV entries
    positions: int = 0
    computed: int = 0
    # positions -> kv_sum after them, at every whole prefix block: what trimming goes back to
    marks: dict[int, np.ndarray] = attrs.field(factory=dict)
    inputs: list[np.ndarray] = attrs.field(factory=list)  # each position's input row, float32 [W]
    ids: list[int] = attrs.field(factory=list)  # each position's token id (-1: none came)


@attrs.define
class StubBackend(ShardBackend):
    spec: StubSpec
    layers: LayerRange
    delay_s: float = 0.0
    capacity: int = 64
    n_ctx: int | None = None  # positions per session (--ctx); None: the spec's context_length
    name: str = "stub"
    devices: tuple[DeviceMemory, ...] = ()  # what device_memory reports (a test's fake GPU; none on the CPU)
    info: ModelInfo = attrs.field(init=False)
    _a: np.ndarray = attrs.field(init=False)  # float32 [n_local, W]
    _b: np.ndarray = attrs.field(init=False)  # float32 [n_local, W]
    _embed: np.ndarray = attrs.field(init=False)  # float32 [vocab, W]
    _unembed: np.ndarray = attrs.field(init=False)  # float32 [W, vocab]
    _depth: np.ndarray = attrs.field(init=False)  # float32 [n_local]: each layer's number plus one (its phase's rate)
    _table: SessionTable[_Session] = attrs.field(init=False)  # open sessions, and the checks an open meets
    _kept: dict[str, _Session] = attrs.field(factory=dict)  # kept prefix key -> its state (dgr.node.prefix)

    def __attrs_post_init__(self) -> None:
        self.info = self.spec.info()
        if self.layers.stop > self.spec.n_layers:
            raise CallerError(Reason.INVALID_REQUEST, f"layers {self.layers} exceed the stub's {self.spec.n_layers}")
        w, v = self.spec.seam_width, len(STUB_VOCAB)
        per_layer = [np.random.default_rng([self.spec.seed, il]) for il in range(self.layers.start, self.layers.stop)]
        self._a = np.stack([r.uniform(0.5, 1.5, w) for r in per_layer]).astype(np.float32)
        self._b = np.stack([r.uniform(-0.5, 0.5, w) for r in per_layer]).astype(np.float32)
        glob = np.random.default_rng([self.spec.seed, 10_000])
        self._embed = glob.standard_normal((v, w)).astype(np.float32)
        self._unembed = (glob.standard_normal((w, v)) / np.sqrt(w)).astype(np.float32)
        self._depth = np.arange(self.layers.start + 1, self.layers.stop + 1, dtype=np.float32)
        self._table = SessionTable("this shard", self.capacity, self.max_positions())

    # -- sessions -------------------------------------------------------------
    def open_session(self, sid: str, max_positions: int, lane: int | None = None) -> None:
        n_local = len(self.layers)
        self._table.open(sid, max_positions, _Session(max_positions, np.zeros((n_local, self.spec.seam_width), np.float32)),
                         in_use=self._in_use())

    def close_session(self, sid: str) -> None:
        self._table.pop(sid)

    def session_count(self) -> int:
        return len(self._table.live)

    # -- prefix cache ----------------------------------------------------------
    prefix_capable = True

    def _trimmed(self, s: _Session, positions: int) -> _Session:
        """A copy of `s` holding only its first `positions` positions: back to the whole block before, then
        those after it computed again from their inputs."""
        if not 0 <= positions <= s.positions:
            raise CallerError(Reason.POSITION_DISCONTINUITY, f"cannot keep {positions} of {s.positions} positions")
        block = positions // BLOCK_TOKENS * BLOCK_TOKENS
        if block and block not in s.marks:
            raise CallerError(Reason.POSITION_DISCONTINUITY, f"no state kept at {block} of {s.positions}")
        marks = {p: m.copy() for p, m in s.marks.items() if p <= block}
        kv = marks[block].copy() if block else np.zeros_like(s.kv_sum)
        out = _Session(s.max_positions, kv, block, s.computed, marks, s.inputs[:block], s.ids[:block])
        if positions > block:
            ids = s.ids[block:positions]
            self._layers(out, block, None if min(ids) < 0 else np.asarray(ids, np.int32),
                         np.stack(s.inputs[block:positions]))
        return out

    def keep_prefix(self, sid: str, key: str, positions: int) -> int:
        s = self._table.pop(sid)
        self._kept[key] = self._trimmed(s, positions)
        return positions * s.kv_sum.nbytes

    def open_from_prefix(self, sid: str, max_positions: int, key: str, positions: int, take: bool,
                         lane: int | None = None) -> None:
        # taken over, the prefix's slot becomes the session's: one fewer in use
        self._table.check_open(sid, max_positions, in_use=self._in_use() - (1 if take else 0))
        src = self._kept.pop(key) if take else self._kept[key]
        s = self._trimmed(src, positions)
        self._table.add(sid, max_positions, _Session(max_positions, s.kv_sum, s.positions, 0, s.marks, s.inputs, s.ids))

    def drop_prefix(self, key: str) -> None:
        self._kept.pop(key, None)

    def rename_session(self, sid: str, new: str) -> None:
        self._table.rename(sid, new)

    def trim_session(self, sid: str, positions: int) -> None:
        s = self._table.live[sid]
        self._table.live[sid] = attrs.evolve(self._trimmed(s, positions), computed=s.computed)

    def free_slots(self) -> int:
        return self.capacity - self._in_use()

    def _in_use(self) -> int:
        """Slots held: open sessions and kept prefixes."""
        return len(self._table) + len(self._kept)

    snapshot_capable = True

    def export_prefix(self, key: str) -> bytes:
        s = self._kept[key]
        buf = io.BytesIO()
        inputs = np.stack(s.inputs) if s.inputs else np.zeros((0, s.kv_sum.shape[1]), np.float32)
        np.savez(buf, kv_sum=s.kv_sum, inputs=inputs, ids=np.asarray(s.ids, np.int64),
                 **{f"m{p}": m for p, m in s.marks.items()})
        return buf.getvalue()

    def import_prefix(self, key: str, data: bytes, positions: int) -> int:
        self._table.check_room(self._in_use())
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                marks = {int(k[1:]): z[k] for k in z.files if k.startswith("m")}
                kv_sum, inputs, ids = z["kv_sum"], z["inputs"], z["ids"]
        except (OSError, ValueError, KeyError) as exc:
            raise CallerError(Reason.SNAPSHOT_MISMATCH, f"not a stub prefix: {exc}") from None
        if kv_sum.shape != (len(self.layers), self.spec.seam_width) or inputs.shape[1:] != (self.spec.seam_width,):
            raise CallerError(Reason.SNAPSHOT_MISMATCH, "a stub prefix of another shape")
        if positions != len(inputs) or len(ids) != len(inputs) or max(marks, default=0) > positions:
            raise CallerError(Reason.SNAPSHOT_MISMATCH, f"the stub prefix holds {len(inputs)} positions, "
                                                        f"its manifest claims {positions}", field="positions")
        self._kept[key] = _Session(positions, kv_sum, positions, 0, marks, list(inputs), [int(i) for i in ids])
        return positions * kv_sum.nbytes

    def prefix_bytes(self) -> int:
        return sum(s.positions * s.kv_sum.nbytes for s in self._kept.values())

    def max_sessions(self) -> int:
        return self.capacity

    def max_positions(self) -> int:
        return min(self.n_ctx or self.spec.context_length, self.spec.context_length)

    def positions_computed(self, sid: str) -> int:
        return self._table.live[sid].computed

    def kv_bytes(self) -> int:
        # what a real model would hold: one W-wide entry per layer per position
        return sum(s.positions * s.kv_sum.nbytes for s in self._table.live.values())

    # -- compute --------------------------------------------------------------
    def forward(
        self,
        sid: str,
        pos0: int,
        token_ids: np.ndarray | None,  # int32 [n]
        hidden: np.ndarray | None,  # float32 [n, W]
        want_logits: bool,
    ) -> np.ndarray | None:
        s = self._table.get(sid)
        if pos0 != s.positions:
            raise CallerError(Reason.POSITION_DISCONTINUITY, f"pos0 {pos0} != {s.positions} positions held")
        needs_ids = self.is_head or self.layers.start < self.spec.hash_layers
        if needs_ids and token_ids is None:
            raise CallerError(Reason.BAD_FRAME, f"layers {self.layers} need token ids")
        if self.is_head:
            h = self._embed[np.asarray(token_ids, dtype=np.int64)]  # [n, W]
        else:
            if hidden is None or hidden.ndim != 2 or hidden.shape[1] != self.info.seam_width:
                raise CallerError(Reason.WRONG_WIDTH, f"expected hidden [n, {self.info.seam_width}]")
            h = np.array(hidden, dtype=np.float32)
        h = self._layers(s, pos0, None if token_ids is None else np.asarray(token_ids, np.int32), h)
        n = h.shape[0]
        s.computed += n
        if self.delay_s:
            time.sleep(self.delay_s * n)  # simulated compute time; runs in a worker thread
        if not self.is_tail:
            return h.astype(np.float32)
        if not want_logits:
            return None
        rows = int(want_logits)
        logits = h[-rows:] @ self._unembed  # [rows, vocab]
        logits[:, _EOS] -= 4.0  # rare end of generation, so answers have some length
        return logits[0].astype(np.float32) if rows == 1 else logits.astype(np.float32)

    def forward_batch(self, steps: Sequence[Step]) -> list[outcome.Outcome]:
        """Each step as `forward` computes it; the one-position steps of distinct sessions that `forward` would
        accept, all at once (`forward_rows`), the others one by one (which raise what they raise)."""
        rows = self._rows(steps)
        rest = sorted(set(range(len(steps))) - set(rows))
        out = dict(zip(rest, super().forward_batch([steps[i] for i in rest])))
        if rows:
            try:
                out.update((i, outcome.Value(o)) for i, o in zip(rows, self.forward_rows([steps[i] for i in rows])))
            except COMPUTE_ERRORS as exc:  # checked beforehand, so nothing expected: every row fails alike
                out.update((i, outcome.Error(exc)) for i in rows)
        return [out[i] for i in range(len(steps))]

    def _rows(self, steps: Sequence[Step]) -> list[int]:
        """The steps `forward_rows` may take: one position each, of distinct open sessions at the position they
        hold, with the inputs these layers need (everything `forward` checks), and one row of logits at most."""
        needs_ids = self.is_head or self.layers.start < self.spec.hash_layers
        vocab, seen, rows = len(STUB_VOCAB), set(), []
        for i, st in enumerate(steps):
            s = self._table.live.get(st.sid)
            ids, hidden = st.token_ids, st.hidden
            if (s is None or st.sid in seen or st.pos0 != s.positions or st.n_tokens != 1 or int(st.want_logits) > 1
                    or (needs_ids and (ids is None or not 0 <= int(ids[0]) < vocab))
                    or (not self.is_head and (hidden is None or hidden.shape != (1, self.info.seam_width)))):
                continue
            seen.add(st.sid)
            rows.append(i)
        return rows

    def forward_rows(self, steps: Sequence[Step]) -> list[np.ndarray | None]:
        """One position of each of several sessions (`_rows`), each as `forward` gives it: elementwise ops round alike
        whatever the shape, a one-position running sum is one add, and the tail's matmul still sees one row."""
        sessions = [self._table.live[st.sid] for st in steps]
        needs_ids = self.is_head or self.layers.start < self.spec.hash_layers
        ids = np.array([int(st.token_ids[0]) for st in steps], np.int64) if needs_ids else None  # [B]
        if self.is_head:
            h = self._embed[ids]  # [B, W]
        else:
            h = np.concatenate([st.hidden for st in steps]).astype(np.float32)  # [B, W]
        pos = np.array([st.pos0 for st in steps], np.float32)[:, None]  # [B, 1]
        kv = np.stack([s.kv_sum for s in sessions])  # [B, L, W]
        for s, row, st in zip(sessions, h, steps):
            s.inputs.append(row.astype(np.float32))  # a copy: the session keeps its own row
            s.ids.append(-1 if st.token_ids is None else int(st.token_ids[0]))
        # `_layers`' ops in its order, in place: all layers' phases at once ([B, L]), the running sum added into kv
        phases = (pos * self._depth % 97.0) / 97.0 - 0.5  # [B, L]
        pos1 = pos + 1.0
        hashed = 0.25 * self._embed[ids] if self.layers.start < self.spec.hash_layers else None
        k, t = np.empty_like(h), np.empty_like(h)
        for i, il in enumerate(range(self.layers.start, self.layers.stop)):
            if il < self.spec.hash_layers:
                h += hashed
            np.multiply(h, self._a[i], out=k)
            k += self._b[i]
            k += phases[:, i : i + 1]
            k /= np.add(np.abs(k, out=t), 1.0, out=t)  # softsign: this layer's KV entries
            run = kv[:, i]
            run += k  # [B, W]: each session's running sum, one position on
            np.divide(run, pos1, out=k)
            k *= self._a[i]
            k /= np.add(np.abs(k, out=t), 1.0, out=t)
            k *= 0.5
            h += k
        out: list[np.ndarray | None] = []
        for b, (s, st) in enumerate(zip(sessions, steps)):
            s.kv_sum[...] = kv[b]
            if (st.pos0 + 1) % BLOCK_TOKENS == 0:  # a whole block: what trimming goes back to
                s.marks.setdefault(st.pos0 + 1, np.zeros_like(s.kv_sum))[...] = kv[b]
            s.positions += 1
            s.computed += 1
            if not self.is_tail:
                out.append(h[b : b + 1].astype(np.float32))
            elif not st.want_logits:
                out.append(None)
            else:
                logits = h[b : b + 1] @ self._unembed  # [1, vocab]
                logits[:, _EOS] -= 4.0
                out.append(logits[0].astype(np.float32))
        if self.delay_s:
            time.sleep(self.delay_s * len(steps))  # a position's delay each, as one by one
        return out

    def _layers(self, s: _Session, pos0: int, token_ids: np.ndarray | None, h: np.ndarray) -> np.ndarray:
        """This shard's layers over input rows `h` [n, W] at positions pos0..: `s`'s KV grows by them."""
        n = h.shape[0]
        s.inputs.extend(h.astype(np.float32))
        s.ids.extend([-1] * n if token_ids is None else [int(t) for t in token_ids])
        pos = np.arange(pos0, pos0 + n, dtype=np.float32)[:, None]  # [n, 1]
        for i, il in enumerate(range(self.layers.start, self.layers.stop)):
            if il < self.spec.hash_layers:
                h = h + 0.25 * self._embed[np.asarray(token_ids, dtype=np.int64)]
            phase = (pos * (il + 1) % 97.0) / 97.0 - 0.5  # [n, 1]: a RoPE-like dependence on the absolute position
            k = _softsign(h * self._a[i] + self._b[i] + phase)  # [n, W]: this layer's KV entries
            # sequential running sum: identical whatever the chunking
            run = np.cumsum(np.vstack([s.kv_sum[i : i + 1], k]), axis=0)[1:]  # [n, W]
            s.kv_sum[i] = run[-1]
            for p in range((pos0 // BLOCK_TOKENS + 1) * BLOCK_TOKENS, pos0 + n + 1, BLOCK_TOKENS):
                s.marks.setdefault(p, np.zeros_like(s.kv_sum))[i] = run[p - pos0 - 1]
            h = h + 0.5 * _softsign(run / (pos + 1.0) * self._a[i])  # [n, W]
        s.positions += n
        return h

    # -- text -----------------------------------------------------------------
    text_apart = True  # pure Python over constant tables

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool) -> list[int]:
        return [_ID.get(ch, _ID["?"]) for ch in text]

    def render_chat(self, messages: list[ChatMessage]) -> str:
        lines = [f"<{m.get('role', 'user')}>: {m.get('content', '')}" for m in messages]
        return "\n".join(lines) + "\n<assistant>:"

    def token_bytes(self, token: int) -> bytes:
        return b"" if token == _EOS else STUB_VOCAB[token].encode()

    def is_eog(self, token: int) -> bool:
        return token == _EOS

    def device_memory(self) -> list[DeviceMemory]:
        return list(self.devices)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "layers": str(self.layers), "architecture": "stub", "n_layers": self.spec.n_layers,
                "hidden_size": self.spec.hidden_size, "seam_width": self.spec.seam_width, "delay_s": self.delay_s}
