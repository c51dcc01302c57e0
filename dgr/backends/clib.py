"""The C libraries dgr calls through ctypes, loaded and declared in one place.

- libllama (`llama_lib`): llama-cpp-python's ctypes module, with the backend initialised once and
  llama.cpp's log routed into a small ring buffer (printed only with DGR_LLAMA_LOG=1), so load errors
  can quote llama.cpp's own reason (`llama_log_tail`). `llama_module` is the same module before the
  backend's initialisation, which registers the built backends: a CUDA backend counts its devices,
  and that initialises the CUDA driver, which a process forked afterwards cannot use
  (cudaErrorInitializationError). What runs before a fork (dgr.forks.preload, `dgr up`'s checks of
  the model) asks `llama_module` only; loading and the layer-range gate need no device.
- libllama's layer-range API (`range_api`): dgr carries one patch series for llama.cpp
  (llama/patches/, written to be sent upstream; spec/llama-layer-boundary.md). Its public API is two
  fields of `llama_model_params`, `layer_start` and `layer_end`, honoured by every loader: only the
  tensors of layers [layer_start, layer_end) of the unmodified GGUF are loaded, the token embedding
  only where the range needs it and the output head only on the range that ends at the last layer.
  A range that starts late takes `batch.embd` rows `llama_model_n_embd_inp` wide; one that ends early
  is an embeddings context that outputs every row (`llama_get_embeddings`), `llama_model_n_embd_out`
  wide: n_embd for most models, hc_mult x n_embd for DeepSeek-V4's hyper-connection streams.
  Two functions staged in libllama's `src/llama-ext.h`, not in `llama.h`: `llama_arch_supports_layer_range`
  says which architectures libllama loads a range of (each opts in where a test proves its split), and
  `llama_model_layers_read_tokens(model)` whether layers past layer 0 read token ids (DeepSeek-V4's
  hash-routed experts), so that a range starting late takes them beside its hidden states
  (dgr.backends.llama_batch).
  llama-cpp-python is built with a mirror of the patched struct (llama/bindings/), which `llama_lib`
  checks against libllama's own defaults. A stock llama-cpp-python build lacks the range API, and
  `range_api` refuses it with the way to get the patched build.
- libggml-base (`ggml_lib`): from llama-cpp-python's lib folder: type names, and the gguf writer the
  tiny test models are written with; `model_builder_api` adds libllama's build-from-memory functions.

Rules: importing this module loads nothing; each library is loaded on its first use, declared once,
and kept for the process's life (a freed log callback would crash the next log call).

Left out: driving the libraries (dgr.backends.llama_engine, dgr.backends.gguf_text) and reading GGUF
headers (dgr.gguf_meta, in Python: one `GgufHeader` for every reader).
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
from pathlib import Path
from typing import Any

from dgr.errors import CallerError, Reason

__all__ = ["GgufInitParams", "PATCHED_BUILD_HINT", "arch_takes_ranges", "ggml_lib", "llama_lib", "llama_log_tail",
           "llama_module", "model_builder_api", "model_reads_tokens", "range_api", "seam_width"]

_LOG: collections.deque[str] = collections.deque(maxlen=40)
_LIB: dict[str, Any] = {}


def llama_lib() -> Any:
    """The `llama_cpp.llama_cpp` ctypes module, with the backend initialised once."""
    if "lib" in _LIB:
        return _LIB["lib"]
    lib = llama_module()
    lib.llama_backend_init()  # registers the built backends: a GPU's counts its devices
    _LIB["lib"] = lib
    return lib


def llama_module() -> Any:
    """The `llama_cpp.llama_cpp` ctypes module, loaded and declared, its log routed; its backend not initialised,
    so that no device is touched yet: fork-safe, for what runs before a fork (a CUDA driver initialised in
    the parent is unusable in its children)."""
    if "module" in _LIB:
        return _LIB["module"]
    import llama_cpp.llama_cpp as lib  # deferred: importing it loads libllama

    echo = os.environ.get("DGR_LLAMA_LOG") == "1"

    @lib.llama_log_callback
    def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", "replace")
        _LOG.append(line)
        if echo:
            sys.stderr.write(line)

    lib.llama_log_set(_log, ctypes.c_void_p(0))
    _LIB["log_cb"] = _log  # a freed callback would crash the next log call
    if hasattr(lib._lib, _RANGE_SYMBOL):
        _declare_range_api(lib)
    _LIB["module"] = lib
    return lib


_RANGE_SYMBOL = "llama_arch_supports_layer_range"  # a libllama built with dgr's patch series exports it


def _declare_range_api(llama: Any) -> None:
    """Declare the range functions of `llama-ext.h`, and check that llama-cpp-python's `llama_model_params` is the patched
    layout (layer_start, layer_end before the booleans: llama/bindings/): a struct of another size passed by
    value would be read, or written, past its end."""
    lib, vp = llama._lib, ctypes.c_void_p
    lib.llama_model_layers_read_tokens.argtypes, lib.llama_model_layers_read_tokens.restype = [vp], ctypes.c_bool
    lib.llama_arch_supports_layer_range.argtypes = [ctypes.c_char_p]
    lib.llama_arch_supports_layer_range.restype = ctypes.c_bool
    d = lib.llama_model_default_params() if "layer_end" in dict(llama.llama_model_params._fields_) else None
    if d is None or (d.layer_start, d.layer_end, d.use_extra_bufts, d.load_mtp) != (0, -1, True, False):
        raise CallerError(Reason.MODEL_LOAD_FAILED, "llama-cpp-python's llama_model_params is not the layout of "
                          f"dgr's patched libllama; {PATCHED_BUILD_HINT}")


def llama_log_tail(n: int = 6) -> str:
    """The last lines llama.cpp logged, joined, for error messages."""
    return "".join(list(_LOG)[-n:]).strip()


PATCHED_BUILD_HINT = (
    "this llama-cpp-python was built without dgr's layer-range patches (llama/patches/ in the dgr tree); "
    "run `make install` in the dgr checkout, which builds llama-cpp-python from its sdist with the patches "
    "applied (or reinstall it with `pip uninstall llama-cpp-python` first, then `make install`)"
)
_API: dict[str, Any] = {}


def range_api() -> Any:
    """llama-cpp-python's ctypes module, where libllama has the layer-range API (declared; the backend not
    initialised by this: `llama_module`, fork-safe).

    Raises:
        CallerError(MODEL_LOAD_FAILED): the installed libllama has no
        layer-range API (a stock build); the message says how to get it.
    """
    lib = llama_module()
    if not hasattr(lib._lib, _RANGE_SYMBOL):
        raise CallerError(Reason.MODEL_LOAD_FAILED, PATCHED_BUILD_HINT)
    return lib


def arch_takes_ranges(arch: str) -> bool:
    """Whether libllama loads a layer range of `arch` (its GGUF general.architecture); no on a stock build.
    Fork-safe (`llama_module`): `dgr up` asks before it forks its nodes."""
    lib = llama_module()._lib
    return hasattr(lib, _RANGE_SYMBOL) and bool(lib.llama_arch_supports_layer_range(arch.encode()))


def model_reads_tokens(model: int) -> bool:
    """Whether layers past layer 0 read token ids (DeepSeek-V4's hash routing); no on a stock build (no ranges)."""
    lib = llama_lib()._lib
    return hasattr(lib, _RANGE_SYMBOL) and bool(lib.llama_model_layers_read_tokens(model))


def seam_width(model: int, start: int, stop: int) -> int:
    """Floats per position crossing a boundary of the range [start, stop) of a loaded model: what a range ending
    early outputs, else what one starting late takes; n_embd for a whole model (nothing crosses)."""
    lib = llama_lib()
    if stop < lib.llama_model_n_layer(model):
        return lib.llama_model_n_embd_out(model)
    return lib.llama_model_n_embd_inp(model) if start > 0 else lib.llama_model_n_embd(model)


_GGML: dict[str, Any] = {}


class GgufInitParams(ctypes.Structure):
    """gguf_init_params: `no_alloc`, and where to put the ggml context holding the tensors (or NULL)."""

    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def ggml_lib() -> ctypes.CDLL:
    """libggml-base from llama-cpp-python's lib folder: type names, and the gguf writer and tensor
    functions that write the tiny test models (dgr.testing.arch_models: ggml itself writes them)."""
    lib = _GGML.get("lib")
    if lib is not None:
        return lib
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    vp, cp, sz, i64 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64
    for name, args, res in [
        ("ggml_type_name", [ctypes.c_int], cp),
        ("gguf_init_empty", [], vp),
        ("gguf_free", [vp], None),
        ("gguf_set_val_u32", [vp, cp, ctypes.c_uint32], None),
        ("gguf_set_val_i32", [vp, cp, ctypes.c_int32], None),
        ("gguf_set_val_u64", [vp, cp, ctypes.c_uint64], None),
        ("gguf_set_val_i64", [vp, cp, ctypes.c_int64], None),
        ("gguf_set_val_u8", [vp, cp, ctypes.c_uint8], None),
        ("gguf_set_val_i8", [vp, cp, ctypes.c_int8], None),
        ("gguf_set_val_f32", [vp, cp, ctypes.c_float], None),
        ("gguf_set_val_bool", [vp, cp, ctypes.c_bool], None),
        ("gguf_set_val_str", [vp, cp, cp], None),
        ("gguf_set_arr_data", [vp, cp, ctypes.c_int, vp, sz], None),
        ("gguf_set_arr_str", [vp, cp, ctypes.POINTER(cp), sz], None),
        ("gguf_set_kv", [vp, vp], None),
        ("gguf_add_tensor", [vp, vp], None),
        ("gguf_write_to_file", [vp, cp, ctypes.c_bool], ctypes.c_bool),
        ("gguf_init_from_file", [cp, GgufInitParams], vp),
        ("gguf_get_n_tensors", [vp], i64),
        ("gguf_get_tensor_name", [vp, i64], cp),
        ("ggml_get_tensor", [vp, cp], vp),
        ("ggml_free", [vp], None),
        ("ggml_get_name", [vp], cp),
        ("ggml_nelements", [vp], i64),
        ("ggml_nbytes", [vp], sz),
        ("ggml_backend_tensor_set", [vp, vp, sz, sz], None),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _GGML["lib"] = lib
    return lib


def model_builder_api() -> Any:
    """libllama (as `range_api`) with the functions that build a model from tensors in memory and save it:
    how the tiny test models get llama.cpp's own layout (dgr.testing.arch_models)."""
    lib = _API.get("builder")
    if lib is not None:
        return lib
    llama_lib()  # the backends registered, as a model built in memory places its tensors on one
    lib = range_api()._lib  # llama_model_init_from_user is declared with the patched params there
    for name, args, res in [
        ("llama_model_save_to_file", [ctypes.c_void_p, ctypes.c_char_p], None),
        ("llama_model_free", [ctypes.c_void_p], None),
    ]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _API["builder"] = lib
    return lib
