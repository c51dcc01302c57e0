"""The draft model the bench and tests use: the default model requantized, made here, never downloaded.

SmolLM2-135M is its family's smallest model, and no code may fetch another
from a model hub, so the only same-family draft at hand is the default model
itself at another quantization: Q4_0 from its Q4_1 (llama.cpp's
`llama_model_quantize`, requantizing). Its vocabulary is the target's by
construction; it decodes in about 80% of the target's time on one thread and
agrees with it on most greedy tokens, which is what a draft needs. The file
is cached beside the other built models (dgr.bench.shapes), keyed by the
source's size and mtime.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["draft_model_path", "requantize"]


def requantize(src: Path, dst: Path, ftype: str = "Q4_0") -> Path:
    """Write `src` requantized to `ftype` (a llama.cpp LLAMA_FTYPE_MOSTLY_* name) at `dst`.

    Raises:
        RuntimeError: llama.cpp refused.
    """
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    dst.parent.mkdir(parents=True, exist_ok=True)
    part = dst.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
    if rc != 0:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {src.name} -> {ftype}: {rc}")
    part.replace(dst)
    return dst


def draft_model_path(ftype: str = "Q4_0") -> Path:
    """The default model at `ftype`, made once and cached."""
    from dgr.bench.shapes import built_models_dir
    from dgr.models import default_model_path

    src = default_model_path()
    st = src.stat()
    dst = built_models_dir() / f"{src.stem}.{ftype.upper()}-draft-{st.st_size}-{int(st.st_mtime)}.gguf"
    return dst if dst.is_file() else requantize(src, dst, ftype)
