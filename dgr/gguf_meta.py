"""GGUF facts dgr relies on, in one place: tensor naming, tensor roles, metadata fields.

The manifest (dgr.artifact.manifest), the planner (dgr.plan), the shard-file
writer (dgr.backends.shardfile), the torch model (dgr.backends.torch_model) and
the llama engine (dgr.backends.llama_engine) all read GGUF files. Each used to
carry its own `blk.N.` pattern, its own field reader and, for global tensors,
its own role rule; two of those rules disagreed (DeepSeek-V4's `output_hc_*`
was a tail tensor to the planner and a shared one to the manifest). This
module is the one answer they all ask.

Rules:
- Parsing is gguf-py's `GGUFReader` (`open_reader`); dgr writes no parser.
  The llama engine reads headers with ggml's own C parser for speed, but asks
  this module what the names and keys mean.
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
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

if TYPE_CHECKING:
    import gguf

__all__ = [
    "ARCHITECTURE_KEY",
    "GLOBAL_ROLES",
    "LAYER_PREFIX",
    "NAME_KEY",
    "arch_key",
    "field",
    "global_role",
    "is_tied",
    "layer_of",
    "layer_tensor_name",
    "metadata",
    "open_reader",
    "require_field",
    "Role",
    "split_layer_name",
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


# Global tensor name prefix (before the first '.', a shell pattern) -> role. Anything
# else that is not blk.N.* is SHARED. token_embd becomes HEAD_TAIL when the file has
# no output.weight (tied embeddings). output_hc_* (DeepSeek-V4's hc_head: output_hc_fn,
# _base, _scale) collapses the 4 hyper-connection streams after the last layer, before
# output_norm (llama.cpp src/models/deepseek4.cpp), so only the tail computes with it.
GLOBAL_ROLES: dict[str, Role] = {
    "token_embd": Role.HEAD,
    "token_embd_norm": Role.HEAD,
    "output_norm": Role.TAIL,
    "output": Role.TAIL,
    "output_hc_*": Role.TAIL,
}

_LAYER = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.(.+)$")


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


def global_role(name: str, *, tied: bool) -> Role:
    """Which shards compute with the global (non-layer) tensor `name`.

    The prefix before the first '.' is looked up in GLOBAL_ROLES (shell
    patterns allowed: DeepSeek-V4's `output_hc_*` is the hc_head that collapses
    the 4 hyper-connection streams after the last layer, so the tail needs it);
    anything else is SHARED. With tied embeddings token_embd is the tail's LM
    head too.
    """
    prefix = name.split(".", 1)[0]
    role = next((r for pat, r in GLOBAL_ROLES.items() if fnmatch.fnmatchcase(prefix, pat)), Role.SHARED)
    if role is Role.HEAD and tied and prefix == "token_embd":
        return Role.HEAD_TAIL
    return role


def tensor_role(name: str, *, tied: bool) -> Role:
    """LAYER for `blk.N.*`, else `global_role`."""
    return Role.LAYER if layer_of(name) is not None else global_role(name, tied=tied)


# -- reading -------------------------------------------------------------------------


def open_reader(path: str | Path) -> gguf.GGUFReader:
    """gguf-py's reader of `path` (memory-mapped: no tensor data is read).

    Raises:
        CallerError(MODEL_LOAD_FAILED): missing, not GGUF, truncated or corrupt.
    """
    import gguf  # heavy import (numpy memmaps); only when a file is read

    p = check_gguf_file(path)
    try:
        return gguf.GGUFReader(p, "r")
    except (ValueError, IndexError, OSError, KeyError) as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot parse GGUF {p} (truncated or corrupt?): {exc}") from None


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata `key`, or `default` when the file does not set it."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def require_field(reader: gguf.GGUFReader, key: str, path: str | Path) -> Any:
    """The value of metadata `key`.

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file does not set it.
    """
    f = reader.fields.get(key)
    if f is None:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF metadata lacks {key!r}: {path}")
    return f.contents()


def metadata(reader: gguf.GGUFReader, *, skip: tuple[str, ...] = ("tokenizer.", "GGUF.")) -> dict[str, Any]:
    """Every metadata key and value, less those under `skip` (the vocabulary arrays are large)."""
    return {key: f.contents() for key, f in reader.fields.items() if not key.startswith(skip)}
