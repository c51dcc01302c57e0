"""Shard GGUF files: layers [a, b) of a full GGUF, as a model llama.cpp can load.

llama.cpp has no API to load a layer range (see spec/llama-layer-boundary.md),
so a shard is a real GGUF file derived from the full one:
- every metadata key is copied; `{arch}.block_count` becomes b - a, and every
  `{arch}.*` array with one entry per layer (feed_forward_length,
  attention.head_count(_kv), ...) is sliced to [a, b);
- tensors `blk.{a..b-1}.*` are kept and renumbered `blk.{0..b-a-1}.*`; all
  non-layer tensors (token_embd, output_norm, output, rope_freqs) are kept,
  because the loader requires them and silently mis-computes RoPE without
  rope_freqs; the loader also rejects any extra tensor, so nothing else stays;
- tensor bytes are copied verbatim: quantized blocks need no re-encoding;
- for an architecture whose loader assigns sliding-window layers by a period
  of the *local* layer index (Gemma 2 and 3; dgr.backends.llama_arch), the
  source's per-layer pattern is written as a bool array sliced to [a, b), in
  the key the loader reads first (`{arch}.attention.sliding_window_pattern`,
  src/llama-model.cpp:3434-3441), so layer a of a shard keeps the kind (and
  RoPE base) it has in the whole model whatever the split.

Shard files live in a cache dir (`$DGR_CACHE_DIR`, else ~/.cache/dgr/shards),
named by the source's sha256 and the range, so a changed source gets new
shards and nothing is ever written next to the user's model. Files are
written to a temporary name and renamed, so nodes that share the cache never
see half a file.

The sha256 of a source is itself cached, keyed by (path, size, mtime_ns), so
a node start does not rehash the model each time.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from dgr.backends.base import LayerRange
from dgr.backends.llama_arch import SHARD_RULES, swa_layers
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import (ARCHITECTURE_KEY, GgufHeader, arch_key, field, layer_tensor_name, read_header,
                           split_layer_name, tensor_data)
from dgr.models import check_gguf_file
from dgr.progress import NullProgress, Progress

__all__ = ["SHARD_FORMAT", "cache_dir", "file_sha256", "remember_sha256", "shard_path", "write_shard"]

# Bump when the shard layout changes, so old cached shards are not reused.
SHARD_FORMAT = 2
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where shard files and source digests are cached."""
    env = os.environ.get("DGR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dgr" / "shards"


def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _memo_path(p: Path, st: os.stat_result) -> Path:
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "digests" / key


def remember_sha256(path: str | Path, digest: str) -> None:
    """Record `digest` as the sha256 of `path` (as it is now), so file_sha256 does not read it.

    For a sparse partial download whose needed tensors were verified against
    a Model Artifact manifest: its own bytes (holes read as zeros) would hash
    to something else, and hashing every hole of a large model costs minutes,
    while the pieces it holds are the manifest file's (digest = manifest
    file.sha256). Any later write changes mtime and drops the record.

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file cannot be stat'ed.
    """
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    _atomic_write_text(_memo_path(p, st), digest)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file, streamed in 1 MiB chunks; cached by (path, size, mtime_ns).

    Raises:
        CallerError(MODEL_LOAD_FAILED): the file cannot be read.
    """
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    memo = _memo_path(p, st)
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    try:
        with p.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    digest = h.hexdigest()
    try:
        _atomic_write_text(memo, digest)
    except OSError:
        pass  # a read-only cache only costs a rehash next time
    return digest


def shard_path(source: str | Path, layers: LayerRange, *, root: Path | None = None) -> Path:
    """Path of the cached shard GGUF for `layers` of `source`, built if missing.

    Raises:
        CallerError(MODEL_LOAD_FAILED): unreadable source, or a range outside it.
    """
    src = check_gguf_file(source)
    digest = file_sha256(src)
    out = (root or cache_dir()) / f"{digest}.v{SHARD_FORMAT}.{layers.start}-{layers.stop}.gguf"
    if not out.is_file():
        from dgr.progress import terminal_progress

        with terminal_progress() as progress:
            write_shard(src, layers, out, progress=progress)
    return out


def write_shard(source: str | Path, layers: LayerRange, out: str | Path, *, progress: Progress | None = None) -> None:
    """Write the GGUF of layers [start, stop) of `source` to `out` (atomically).

    Raises:
        CallerError(MODEL_LOAD_FAILED): the source is not a usable GGUF or the
        range does not fit its layer count.
    """
    src = check_gguf_file(source)
    out = Path(out)
    header = read_header(src)
    file = np.memmap(src, dtype=np.uint8, mode="r")
    arch = field(header, ARCHITECTURE_KEY)
    if arch is None:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF has no {ARCHITECTURE_KEY}: {src}")
    count_key = arch_key(arch, "block_count")
    if count_key not in header.fields:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF has no {count_key}: {src}")
    n_layer = int(header.fields[count_key])
    if layers.stop > n_layer:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED, f"layer range {layers} does not fit {n_layer} layers of {src}"
        )

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch=arch)  # little-endian, as read_header reads
        align = header.fields.get(gguf.Keys.General.ALIGNMENT)
        if align is not None:
            writer.data_alignment = int(align)
        _copy_metadata(header, writer, arch, n_layer, layers)
        kept = []
        for t in header.tensors:
            name = _shard_tensor_name(t.name, layers)
            if name is None:
                continue
            data = tensor_data(file, t)
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, gguf.GGMLQuantizationType[t.type])
            kept.append(data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        progress = progress or NullProgress()
        progress.start(f"shard {layers} of {src.name}", sum(int(data.nbytes) for data in kept))
        for data in kept:
            writer.write_tensor_data(data)
            progress.advance(int(data.nbytes))
        writer.close()
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable like the model
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _copy_metadata(header: GgufHeader, writer: gguf.GGUFWriter, arch: str, n_layer: int, layers: LayerRange) -> None:
    prefix = arch_key(arch, "")
    pattern_key = arch_key(arch, "attention.sliding_window_pattern")
    rule = SHARD_RULES.get(arch)
    swa = None
    if rule is not None:
        swa = swa_layers(rule, n_layer, field(header, pattern_key))
    for name, (raw_vtype, raw_sub) in header.value_types.items():
        # general.architecture is written by GGUFWriter itself.
        if name == ARCHITECTURE_KEY:
            continue
        if swa is not None and name == pattern_key:
            continue  # written below, per layer
        vtype = gguf.GGUFValueType(raw_vtype)
        sub_type = None if raw_sub is None else gguf.GGUFValueType(raw_sub)
        if sub_type is gguf.GGUFValueType.ARRAY:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF key {name} is an array of arrays, which no loader reads")
        value = header.fields[name]
        if name == arch_key(arch, "block_count"):
            value = len(layers)
        elif sub_type is not None and name.startswith(prefix) and len(value) == n_layer:
            # Per-layer arrays (llama.cpp's get_key_or_arr(..., n_layer_all)).
            value = value[layers.start : layers.stop]
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    if swa is not None:
        writer.add_key_value(
            pattern_key, swa[layers.start : layers.stop], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL
        )
    # Provenance only; llama.cpp ignores keys it does not know.
    writer.add_uint32("dgr.shard.layer_start", layers.start)
    writer.add_uint32("dgr.shard.layer_stop", layers.stop)
    writer.add_uint32("dgr.shard.source_block_count", n_layer)


def _shard_tensor_name(name: str, layers: LayerRange) -> str | None:
    """The tensor's name in the shard, or None when the shard drops it."""
    parts = split_layer_name(name)
    if parts is None:
        return name  # token_embd, output_norm, output, rope_freqs: the loader needs them
    il, rest = parts
    if not (layers.start <= il < layers.stop):
        return None
    return layer_tensor_name(il - layers.start, rest)
