"""GGUF facts dgr relies on, in one place: tensor naming, tensor roles, metadata fields.

The manifest (dgr.artifact.manifest), the planner (dgr.plan), the torch
model (dgr.backends.torch_model) and the llama engine
(dgr.backends.llama_engine, which loads a layer range straight from the
full file) all read GGUF files. Each used to carry its own `blk.N.`
pattern, its own field reader and, for global tensors, its own role rule;
two of those rules disagreed (DeepSeek-V4's `output_hc_*` was a tail
tensor to the planner and a shared one to the manifest). This module is
the one answer they all ask.

Rules:
- Headers (metadata and the tensor table: what the manifest and the planner
  read) come from `read_header`, a walk over the file's header that decodes
  each value once. gguf-py's `GGUFReader` builds numpy views for every part
  of every field: 2.2 s on SmolLM2's 49k-token vocabulary, paid by every
  `dgr up` and manifest build; the walk takes a tenth of that. The torch
  model reads tensors through `tensor_data`, views into a memory map laid
  out as gguf-py lays them out; the header keeps each value's GGUF type, so
  a writer (dgr.bench.shapes) copies metadata as it was written.
  No dgr code parses a GGUF with gguf-py's reader: it is the oracle the
  walk and the views are tested against. Every reader, the llama backends'
  check before loading included, gets the same `GgufHeader`, which also
  names what a backend needs first (architecture, trunk layers, width,
  training context, bytes by tensor type) as llama.cpp names them.
- A layer tensor is `blk.N.<rest>`; everything else is global, and its role
  is `global_role`: the table `GLOBAL_ROLES` (roles are written into
  manifests, and the table is drawn into spec/artifact-manifest.md), SHARED
  otherwise, and token_embd becomes HEAD_TAIL when the embeddings are tied.

Left out: what the planner derives from the metadata (KV terms, compute
buffers: dgr.plan.rules) and which architectures may be split
(dgr.backends.llama_arch).
"""

from __future__ import annotations

import enum
import fnmatch
import mmap
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

if TYPE_CHECKING:
    import numpy as np  # annotations only: the header walk and the roles need no numpy

__all__ = [
    "ARCHITECTURE_KEY",
    "RECURRENT_HYBRID_ARCHS",
    "GLOBAL_ROLES",
    "LAYER_PREFIX",
    "NAME_KEY",
    "arch_key",
    "field",
    "GgufHeader",
    "HeaderTensor",
    "read_header",
    "is_recurrent_layer",
    "global_role",
    "is_tied",
    "layer_of",
    "layer_tensor_name",
    "metadata",
    "require_field",
    "Role",
    "split_layer_name",
    "tensor_data",
    "tensor_role",
]

ARCHITECTURE_KEY = "general.architecture"
NAME_KEY = "general.name"
LAYER_PREFIX = "blk."


class Role(enum.Enum):
    """Which shards need a tensor. Values are written into the manifest."""

    LAYER = "layer"  # blk.N.*: the shard holding layer N
    HEAD = "head"  # input side: the shard with layer 0
    TAIL = "tail"  # output side: the shard with the last layer
    HEAD_TAIL = "head+tail"  # tied embeddings: both ends
    SHARED = "shared"  # every shard computes with it (rope_freqs)


# Global tensor name prefix (before the first '.', a shell pattern) -> role, as llama.cpp's
# LLM_TENSOR_INFOS gives each tensor's layer kind (input or output). Anything else that is
# not blk.N.* is SHARED. token_embd becomes HEAD_TAIL when the file has no output.weight
# (tied embeddings). output_hc_* (DeepSeek-V4's hc_head: output_hc_fn, _base, _scale)
# collapses the 4 hyper-connection streams after the last layer, before output_norm (llama.cpp
# src/models/deepseek4.cpp), so only the tail computes with it; cls* is a classifier head.
GLOBAL_ROLES: dict[str, Role] = {
    "token_embd": Role.HEAD,
    "token_embd_norm": Role.HEAD,
    "position_embd": Role.HEAD,
    "output_norm": Role.TAIL,
    "output": Role.TAIL,
    "output_hc_*": Role.TAIL,
    "cls": Role.TAIL,
}
# Architectures whose loader gives a GLOBAL_ROLES name another role: LFM2 names its final norm
# token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2, src/models/lfm2.cpp).
ARCH_ROLES: dict[str, dict[str, Role]] = {
    "lfm2": {"token_embd_norm": Role.TAIL},
    "lfm2moe": {"token_embd_norm": Role.TAIL},
}

_LAYER = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.(.+)$")


# Architectures whose linear-attention layers keep recurrent state (gated delta net) and whose
# every `full_attention_interval`-th layer is full attention (llama.cpp src/models/qwen35moe.cpp).
RECURRENT_HYBRID_ARCHS = ("qwen35moe", "qwen35", "qwen3next")


def is_recurrent_layer(arch: str, meta: Mapping[str, Any], il: int) -> bool:
    """Whether layer il of a RECURRENT_HYBRID_ARCHS model is gated delta net, or of minimax-01 lightning
    attention (else full attention).

    An explicit per-layer array, `{arch}.attention.recurrent_layers`, else full attention every
    `{arch}.full_attention_interval`-th layer (default 4, minimax-01 8), as llama.cpp's loader decides.
    """
    flags = meta.get(arch_key(arch, "attention.recurrent_layers"))
    if flags is not None:
        return bool(flags[il] if isinstance(flags, (list, tuple)) else flags)
    default = 8 if arch == "minimax-01" else 4
    interval = int(meta.get(arch_key(arch, "full_attention_interval"), default) or default)
    return (il + 1) % interval != 0


def arch_key(arch: str, key: str) -> str:
    """The per-architecture metadata key `{arch}.{key}` (block_count, embedding_length, ...)."""
    return f"{arch}.{key}"


# -- tensor names and roles ------------------------------------------------------------


def split_layer_name(name: str) -> tuple[int, str] | None:
    """(N, rest) of a layer tensor `blk.N.rest`, or None for a global tensor."""
    m = _LAYER.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


def layer_of(name: str) -> int | None:
    """The layer index of `blk.N.*`, or None for a global tensor."""
    parts = split_layer_name(name)
    return None if parts is None else parts[0]


def layer_tensor_name(il: int, rest: str) -> str:
    """`blk.{il}.{rest}`: the name of a layer tensor."""
    return f"{LAYER_PREFIX}{il}.{rest}"


def is_tied(names: Iterable[str]) -> bool:
    """Whether a model's tensors tie the LM head to token_embd (it has no `output.weight`)."""
    return not any(n == "output.weight" for n in names)


def global_role(name: str, *, tied: bool, arch: str = "") -> Role:
    """Which shards compute with the global (non-layer) tensor `name`.

    The prefix before the first '.' is looked up in GLOBAL_ROLES (shell
    patterns allowed: DeepSeek-V4's `output_hc_*` is the hc_head that collapses
    the 4 hyper-connection streams after the last layer, so the tail needs it);
    anything else is SHARED. With tied embeddings token_embd is the tail's LM
    head too.
    """
    prefix = name.split(".", 1)[0]
    role = ARCH_ROLES.get(arch, {}).get(prefix) or next(
        (r for pat, r in GLOBAL_ROLES.items() if fnmatch.fnmatchcase(prefix, pat)), Role.SHARED
    )
    if role is Role.HEAD and tied and prefix == "token_embd":
        return Role.HEAD_TAIL
    return role


def tensor_role(name: str, *, tied: bool, arch: str = "") -> Role:
    """LAYER for `blk.N.*`, else `global_role`."""
    return Role.LAYER if layer_of(name) is not None else global_role(name, tied=tied, arch=arch)


# -- reading -------------------------------------------------------------------------


@attrs.frozen
class HeaderTensor:
    name: str
    type: str  # ggml type name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # ne0 first, as the file lists it
    offset: int  # absolute, in the file
    n_bytes: int


@attrs.frozen
class GgufHeader:
    """A GGUF's header: its metadata values (as gguf-py's `contents()` gives them) and tensor table."""

    version: int
    fields: Mapping[str, Any]  # with GGUF.version, GGUF.tensor_count, GGUF.kv_count, as gguf-py has them
    # key -> (GGUF value type, item type of an array or None), for the stored keys (not GGUF.*):
    # what a writer needs to copy a value as it was written
    value_types: Mapping[str, tuple[int, int | None]]
    tensors: tuple[HeaderTensor, ...]  # file order
    alignment: int
    data_offset: int

    # What a backend needs before loading the file, named as llama.cpp names it.
    @property
    def architecture(self) -> str:
        """`general.architecture`; "" when absent."""
        arch = self.fields.get(ARCHITECTURE_KEY)
        return arch if isinstance(arch, str) else ""

    def int_field(self, key: str) -> int:
        """An integer metadata value; 0 when the key is absent or not an integer (a bool is not one)."""
        value = self.fields.get(key)
        return value if type(value) is int else 0

    @property
    def n_layer(self) -> int:
        """The trunk: `{arch}.block_count` less `nextn_predict_layers` (next-token-prediction layers follow the
        trunk and load with its last layer, as llama_model_n_layer counts); 0 when absent."""
        arch = self.architecture
        return self.int_field(arch_key(arch, "block_count")) - self.int_field(arch_key(arch, "nextn_predict_layers"))

    @property
    def n_embd(self) -> int:
        """`{arch}.embedding_length`; 0 when absent."""
        return self.int_field(arch_key(self.architecture, "embedding_length"))

    @property
    def context_length(self) -> int:
        """`{arch}.context_length`, the training context; 0 when absent."""
        return self.int_field(arch_key(self.architecture, "context_length"))

    @property
    def tensor_types(self) -> dict[str, int]:
        """ggml type name, as ggml writes it ("q4_1", "f32") -> bytes of tensor data of that type."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.type.lower()] = out.get(t.type.lower(), 0) + t.n_bytes
        return out


# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: str | Path) -> GgufHeader:
    """Metadata and tensor table of the GGUF (v2 or v3, little-endian) at `path`. No tensor data is read.

    Raises:
        CallerError(MODEL_LOAD_FAILED): missing, not GGUF, truncated or corrupt.
    """
    p = check_gguf_file(path)
    try:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _walk(buf)
    except (ValueError, struct.error, UnicodeDecodeError, OverflowError, KeyError, OSError) as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot parse GGUF {p} (truncated or corrupt?): {exc}") from None


def _walk(buf: mmap.mmap) -> GgufHeader:
    import gguf  # the type tables only (block sizes, names), not its reader

    if buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (a big-endian file, or one this reader does not know)")
    off = 24

    def string() -> str:
        nonlocal off
        (n,) = struct.unpack_from("<Q", buf, off)
        end = off + 8 + n
        if end > len(buf):
            raise ValueError("a string runs past the end of the file")
        text = buf[off + 8:end].decode("utf-8")
        off = end
        return text

    def value(vtype: int) -> Any:
        nonlocal off
        if vtype == _STRING:
            return string()
        if vtype == _ARRAY:
            itype, count = struct.unpack_from("<IQ", buf, off)
            off += 12
            if itype == _STRING:
                return [string() for _ in range(count)]
            if itype in _SCALARS:
                fmt = "<" + _SCALARS[itype]
                size = struct.calcsize(fmt)
                items = [v for (v,) in struct.iter_unpack(fmt, buf[off:off + size * count])]
                if len(items) != count:
                    raise ValueError("an array runs past the end of the file")
                off += size * count
                return items
            return [x for _ in range(count) for x in value(itype)]  # nested: flattened, as gguf-py does
        fmt = "<" + _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, buf, off)
        off += struct.calcsize(fmt)
        return v

    fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    value_types: dict[str, tuple[int, int | None]] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, off)
        off += 4
        if key in fields:
            raise ValueError(f"duplicate key {key!r}")
        value_types[key] = (vtype, struct.unpack_from("<I", buf, off)[0] if vtype == _ARRAY else None)
        fields[key] = value(vtype)
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        ttype, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        raw.append((name, tuple(int(d) for d in dims), ttype, rel))
    alignment = int(fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_offset = -(-off // alignment) * alignment
    tensors = []
    for name, dims, ttype, rel in raw:
        qtype = gguf.GGMLQuantizationType(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elems = 1
        for d in dims:
            n_elems *= d
        tensors.append(HeaderTensor(name, qtype.name, dims, data_offset + rel, n_elems * type_size // block))
    return GgufHeader(version, fields, value_types, tuple(tensors), alignment, data_offset)


# ggml types stored as plain numpy items; every other type is quantized blocks, read as bytes
_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


def tensor_data(file: np.ndarray, t: HeaderTensor) -> np.ndarray:
    """`t`'s data in `file` (the whole GGUF as a uint8 array, memory-mapped), shaped as gguf-py's
    `ReaderTensor.data`: numpy order (the file's dims reversed), quantized rows as bytes. No copy."""
    import gguf  # the quantized-shape rule only

    if t.offset + t.n_bytes > len(file):
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"tensor {t.name} runs past the end of the file")
    raw = file[t.offset:t.offset + t.n_bytes]
    np_dims = tuple(reversed(t.shape))
    if t.type in _PLAIN:
        return raw.view(_PLAIN[t.type]).reshape(np_dims)
    return raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, gguf.GGMLQuantizationType[t.type]))


def field(src: GgufHeader, key: str, default: Any = None) -> Any:
    """The value of metadata `key`, or `default` when the file does not set it."""
    return src.fields.get(key, default)


def require_field(src: GgufHeader, key: str, path: str | Path) -> Any:
    """The value of metadata `key`.

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file does not set it.
    """
    if key not in src.fields:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF metadata lacks {key!r}: {path}")
    return src.fields[key]


def metadata(src: GgufHeader, *, skip: tuple[str, ...] = ("tokenizer.", "GGUF.")) -> dict[str, Any]:
    """Every metadata key and value, less those under `skip` (the vocabulary arrays are large)."""
    return {key: value for key, value in src.fields.items() if not key.startswith(skip)}
