"""Tiny random-weight GGUFs of any architecture the vendored llama.cpp knows, made by llama.cpp itself.

`write_arch_gguf(arch, path, n_layer=..., moe=..., seed=...)` writes no tensor
list of its own. It builds the model's metadata in a gguf_context (ggml's C
GGUF API, through ctypes), hands it to libllama's
`llama_model_init_from_user`, which creates every tensor the architecture's
loader asks for (optional ones included) and has a callback here fill each with
random normal values, then writes the model with `llama_model_save_to_file`
(for the few architectures llama.cpp's saver refuses, or writes incompletely,
the metadata given and the tensors created are written here instead). So each
file holds exactly what the vendored loader of that architecture wants,
whatever its tensor names and shapes; only the per-weight ".scale" /
".input_scale" tensors that llama.cpp's generic NVFP4 pass adds to every
weight of a model made from metadata are left out (meaningless for F32
weights; `scale_tensors=True` keeps them).

The metadata is a recipe of dgr.testing.arch_table (`ARCHS`) over the common
keys of dgr.testing.arch_keys, resolved for the model's sizes by
`arch_metadata`. The values are deterministic: a normal(0, stdev) draw seeded
by the tensor's name and `seed`, negative for Mamba's `ssm_a` (state decay).

Left out: a tokenizer (the vocabulary is 128 pieces of llama.cpp's "test"
tokenizer; callers feed token ids), quantized tensors (all F32), realistic
sizes, and architectures that are not decoder-only text models (encoders,
vision, audio, TTS, diffusion and draft models), which are not in `ARCHS`.
"""

from __future__ import annotations

import ctypes
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from dgr.backends.clib import GgufInitParams, ggml_lib, model_builder_api
from dgr.testing.arch_keys import COMMON_KEYS, DROP, MOE_KEYS, STDEV, ArchSpec, Shape, Typed, Value
from dgr.testing.arch_table import ARCHS

__all__ = ["arch_metadata", "write_arch_gguf"]


# -- building the gguf_context ---------------------------------------------------------------------
_GGUF = {"u8": 0, "i8": 1, "u32": 4, "i32": 5, "f32": 6, "bool": 7, "str": 8, "u64": 10, "i64": 11}
_CT = {
    "u8": ctypes.c_uint8, "i8": ctypes.c_int8, "u32": ctypes.c_uint32, "i32": ctypes.c_int32,
    "f32": ctypes.c_float, "bool": ctypes.c_bool, "u64": ctypes.c_uint64, "i64": ctypes.c_int64,
}  # fmt: skip
_GLOBAL_PREFIXES = ("general.", "tokenizer.", "xielu.")


def _resolve(value: Value, shape: Shape) -> Any:
    while callable(value) and not isinstance(value, Typed):
        value = value(shape)
    return value


def arch_metadata(
    arch: str, *, n_layer: int | None = None, moe: bool = False, mtp: bool = False
) -> tuple[dict[str, Any], Shape]:
    """The full metadata of `arch`'s tiny model: {full key: value (Typed where not the default type)}.

    Raises:
        ValueError: `arch` is not in ARCHS, it has no (or only a) MoE variant, or n_layer < 2.
    """
    spec = ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"no tiny-model recipe for architecture {arch!r}; known: {', '.join(sorted(ARCHS))}")
    if moe and spec.moe == "no":
        raise ValueError(f"{arch} has no mixture-of-experts variant")
    n = spec.n_layer if n_layer is None else n_layer
    if mtp and not spec.mtp:
        raise ValueError(f"{arch} has no MTP variant")
    if n < 2:
        raise ValueError(f"n_layer must be at least 2, got {n}")
    # an MTP layer follows the trunk: block_count counts it, nextn_predict_layers says it is one
    shape = Shape(n_layer=n + int(mtp), n_embd=spec.n_embd, n_head=spec.n_head,
                  n_head_kv=spec.n_head if spec.n_head_kv is None else spec.n_head_kv, n_ff=spec.n_ff)  # fmt: skip
    merged: dict[str, Value] = dict(COMMON_KEYS)
    if moe or spec.moe == "only":
        merged.update(MOE_KEYS)
    merged.update(spec.keys)
    if mtp:
        merged["nextn_predict_layers"] = 1
    out: dict[str, Any] = {"general.architecture": arch}
    for key, value in merged.items():
        if value is DROP:
            continue
        full = key if key.startswith(_GLOBAL_PREFIXES) else f"{arch}.{key}"
        out[full] = _resolve(value, shape)
    return out, shape


def _set(g: ctypes.CDLL, ctx: int, key: str, value: Any) -> None:
    k = key.encode()
    kind = None
    if isinstance(value, Typed):
        kind, value = value.kind, value.value
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"metadata {key}: an empty array")
        if kind is None:
            first = value[0]
            kind = "bool" if isinstance(first, bool) else "u32" if isinstance(first, int) else \
                "f32" if isinstance(first, float) else "str" if isinstance(first, str) else None  # fmt: skip
        if kind is None:
            raise ValueError(f"metadata {key}: cannot store an array of {type(value[0]).__name__}")
        if kind == "str":
            arr = (ctypes.c_char_p * len(value))(*[v.encode() for v in value])
            g.gguf_set_arr_str(ctx, k, arr, len(value))
            return
        if kind == "bool":  # gguf stores bool arrays as int8
            data = (ctypes.c_int8 * len(value))(*[1 if v else 0 for v in value])
        else:
            data = (_CT[kind] * len(value))(*value)
        g.gguf_set_arr_data(ctx, k, _GGUF[kind], ctypes.cast(data, ctypes.c_void_p), len(value))
        return
    if kind is None:
        kind = "bool" if isinstance(value, bool) else "u32" if isinstance(value, int) else \
            "f32" if isinstance(value, float) else "str" if isinstance(value, str) else None  # fmt: skip
    if kind is None:
        raise ValueError(f"metadata {key}: cannot store a {type(value).__name__}")
    if kind == "str":
        g.gguf_set_val_str(ctx, k, value.encode())
    else:
        getattr(g, {"f32": "gguf_set_val_f32", "bool": "gguf_set_val_bool"}.get(kind, f"gguf_set_val_{kind}"))(
            ctx, k, value
        )


def _tensor_values(name: str, n: int, seed: int, stdev: float) -> np.ndarray:
    """Deterministic normal(0, stdev) float32 [n] for the tensor `name`; negative for ssm_a."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    v = rng.standard_normal(n, dtype=np.float32) * np.float32(stdev)
    return -np.abs(v) if "ssm_a" in name else v


_GGML_F32, _GGML_F16 = 0, 1


def write_arch_gguf(
    arch: str,
    path: str | Path,
    *,
    n_layer: int | None = None,
    moe: bool = False,
    mtp: bool = False,
    seed: int = 0,
    stdev: float = STDEV,
    scale_tensors: bool = False,
) -> Path:
    """Write a tiny random-weight GGUF of `arch` to `path`, made by libllama; returns the path.

    n_layer: None for the recipe's own (ARCHS[arch].n_layer); moe: the
    mixture-of-experts variant (always on where the architecture has only that);
    mtp: one next-token-prediction layer after the trunk (ArchSpec.mtp).
    scale_tensors: keep the per-tensor ".scale" / ".input_scale" tensors that
    llama.cpp's generic NVFP4 pass (llama_model::load_tensors, after the
    architecture's own loader) creates for every weight of a model made from
    metadata; they mean nothing for F32 weights, so by default the file is
    rewritten without them.

    Raises:
        ValueError: no recipe for `arch`, or an impossible request (see arch_metadata).
        RuntimeError: llama.cpp could not create the model from the metadata
        (its last log lines in the message), or the file was not written.
        CallerError(MODEL_LOAD_FAILED): the installed libllama lacks dgr's
        layer-range patches (dgr.backends.clib.range_api).
        llama.cpp may also abort the process on an inconsistent recipe.
    """
    meta, _shape = arch_metadata(arch, n_layer=n_layer, moe=moe, mtp=mtp)  # raises for an unknown arch
    spec = ARCHS[arch]
    out = Path(path)
    g, lib = ggml_lib(), model_builder_api()
    import llama_cpp.llama_cpp as llama

    errors: list[BaseException] = []
    created: list[int] = []  # ggml_tensor * of every tensor llama.cpp created, in order

    @llama.llama_model_set_tensor_data_t
    def _fill(tensor: int, _ud: int) -> None:
        try:
            name = g.ggml_get_name(tensor).decode()
            n = g.ggml_nelements(tensor)
            ttype = ctypes.c_int.from_address(tensor).value  # ggml_tensor.type is its first field
            v = _tensor_values(name, n, seed, stdev)
            if ttype == _GGML_F16:
                v = v.astype(np.float16)
            elif ttype != _GGML_F32:
                raise RuntimeError(f"tensor {name}: ggml type {ttype} is neither F32 nor F16")
            if v.nbytes != g.ggml_nbytes(tensor):
                raise RuntimeError(f"tensor {name}: {v.nbytes} bytes of values for {g.ggml_nbytes(tensor)}")
            g.ggml_backend_tensor_set(tensor, v.ctypes.data, 0, v.nbytes)
            created.append(tensor)
        except BaseException as e:  # noqa: BLE001 - an exception must not cross into C
            errors.append(e)

    ctx = g.gguf_init_empty()
    model = None
    try:
        for key, value in meta.items():
            _set(g, ctx, key, value)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.load_mtp = mtp  # else the loader skips the MTP layer's tensors, and the file would lack them
        model = lib.llama_model_init_from_user(ctx, _fill, None, params)
        if not model:
            raise RuntimeError(f"llama.cpp cannot create a {arch} model from the metadata: {_log_error()}")
        if errors:
            raise RuntimeError(f"filling {arch}'s tensors failed: {errors[0]!r}") from errors[0]
        out.parent.mkdir(parents=True, exist_ok=True)
        drop = None if scale_tensors else _generic_scale_re(spec)
        if spec.saver:
            lib.llama_model_save_to_file(model, str(out).encode())
            if drop is not None:
                _rewrite_without(g, out, drop)
        else:
            _write_own(g, ctx, created, out, drop)
        if not out.is_file():
            raise RuntimeError(f"{arch}: llama.cpp wrote no file at {out}")
        return out
    finally:
        if model:
            lib.llama_model_free(model)
        g.gguf_free(ctx)


# The weights llama.cpp's generic pass gives optional ".scale" / ".input_scale" tensors (NVFP4 scale2 and
# activation scales), by their GGUF names; created for every such weight of a model made from metadata.
_GENERIC_SCALED = (
    r"attn_(?:q|k|v|output|qkv|gate)|ffn_(?:gate|down|up)(?:_exps|_shexp)?|ssm_(?:in|out|alpha|beta)"
    r"|nextn\.(?:eh_proj|shared_head_head)"
)


def _generic_scale_re(spec: ArchSpec) -> re.Pattern[str]:
    """Names of the generic pass's scale tensors; ".scale" is kept where the architecture's own loader wants it."""
    suffix = "input_scale" if spec.own_scales else "(?:scale|input_scale)"
    return re.compile(rf"^(?:blk\.\d+\.(?:{_GENERIC_SCALED})|output)\.{suffix}$")


def _log_error() -> str:
    """llama.cpp's error lines among its last log lines (else the last lines)."""
    from dgr.backends.clib import llama_log_tail

    lines = [ln for ln in llama_log_tail(40).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln or "failed" in ln]
    return " | ".join((errors or lines)[-3:])


def _write_own(g: ctypes.CDLL, meta_ctx: int, tensors: list[int], out: Path, drop: re.Pattern[str] | None) -> None:
    """The metadata given to llama.cpp, and the tensors it created (their data still in the model's buffers)."""
    ctx = g.gguf_init_empty()
    try:
        g.gguf_set_kv(ctx, meta_ctx)
        seen: set[str] = set()
        for t in tensors:
            name = g.ggml_get_name(t).decode()
            # a tensor every layer asks for (rope_freqs) is created once per layer, as duplicates
            if name not in seen and (drop is None or not drop.match(name)):
                g.gguf_add_tensor(ctx, t)
            seen.add(name)
        if not g.gguf_write_to_file(ctx, str(out).encode(), False):
            raise RuntimeError(f"gguf_write_to_file failed for {out}")
    finally:
        g.gguf_free(ctx)


def _rewrite_without(g: ctypes.CDLL, path: Path, drop: re.Pattern[str]) -> None:
    """Rewrite the GGUF at `path` without the tensors whose names `drop` matches (nothing when none does)."""
    ggml_ctx = ctypes.c_void_p()
    src = g.gguf_init_from_file(str(path).encode(), GgufInitParams(False, ctypes.pointer(ggml_ctx)))
    if not src:
        raise RuntimeError(f"cannot read back {path}")
    dst = g.gguf_init_empty()
    try:
        names = [g.gguf_get_tensor_name(src, i).decode() for i in range(g.gguf_get_n_tensors(src))]
        if not any(drop.match(n) for n in names):
            return
        g.gguf_set_kv(dst, src)
        for n in names:
            if not drop.match(n):
                g.gguf_add_tensor(dst, g.ggml_get_tensor(ggml_ctx, n.encode()))
        tmp = path.with_name(path.name + ".tmp")
        if not g.gguf_write_to_file(dst, str(tmp).encode(), False):
            raise RuntimeError(f"gguf_write_to_file failed for {tmp}")
        tmp.replace(path)
    finally:
        g.gguf_free(dst)
        g.gguf_free(src)
        if ggml_ctx:
            g.ggml_free(ggml_ctx)
