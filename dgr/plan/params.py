"""What a plan is for: `PlanParams` (context and sessions per node, KV type, batch, seam, GPU options), and what
a node costs to run besides its buffers (the runtime's RSS, a GPU's own reserve).

Its own module so that dgr.plan.gpu reads it without importing dgr.plan.cost, which calls dgr.plan.gpu.
"""

from __future__ import annotations

from typing import Any

import attrs

from dgr.artifact.constants import GlobalNeed
from dgr.errors import CallerError, Reason
from dgr.plan.layout import DEFAULT_UBATCH, KV_DTYPES
from dgr.seam.wire import DType

__all__ = ["GPU_RESERVE_BYTES", "LLAMA_CPU_RUNTIME_BYTES", "PlanParams"]


# RSS of a dgr node process before it loads a model: Python, numpy, trio, quart,
# h11, httpx, cryptography (the node's Ed25519 identity) and llama.cpp's
# libraries. 73 to 74 MiB with llama-cpp-python 0.3.36 on this machine before node
# identities; 85.9 MiB since (tests/test_plan.py measures it). The same packages
# take 83 MiB in a long-used virtualenv and 91.8 to 92.2 MiB in one made fresh by
# `make test` (what CI runs): budgeted at the fresh figure, rounded up.
LLAMA_CPU_RUNTIME_BYTES = 100 * 2**20

# Device memory a node's GPU backend takes besides llama.cpp's buffers (the driver's context, the
# kernels, a BLAS workspace). An allowance, not measured here: it varies with the driver and the card,
# and is a few hundred MiB for CUDA; `dgr plan --gpu-reserve` changes it.
GPU_RESERVE_BYTES = 512 * 2**20


@attrs.frozen
class PlanParams:
    """What the plan is for: context and sessions per node, KV dtype, and what a node costs to run."""

    context: int = 4096  # positions per session
    sessions: int = 1  # concurrent Route Sessions each node keeps KV for
    kv_dtype: str = "f16"
    ubatch: int = DEFAULT_UBATCH
    # llama.cpp's default keeps sliding-window caches at full context; DeepSeek-V4 needs it off
    # (llama_context_params.swa_full = false), or every layer's 128-token window costs a full cache.
    swa_full: bool = False
    globals_need: GlobalNeed = attrs.field(default=GlobalNeed.COMPUTE, converter=GlobalNeed)
    runtime_bytes: int = LLAMA_CPU_RUNTIME_BYTES
    seam_width: int | None = None  # None: the model's own
    seam_dtype: str = "f32"
    prefill_chunk: int = 512
    fewest: bool = True  # False: use every node given
    cpu_moe: bool = False  # a GPU node keeps its routed experts in host memory (`--cpu-moe`)
    gpu_reserve_bytes: int = GPU_RESERVE_BYTES

    def __attrs_post_init__(self) -> None:
        if self.context < 1 or self.sessions < 1 or self.ubatch < 1 or self.prefill_chunk < 1:
            raise CallerError(Reason.INVALID_REQUEST, "context, sessions, ubatch and prefill chunk must be positive")
        if self.gpu_reserve_bytes < 0:
            raise CallerError(Reason.INVALID_REQUEST, "the GPU reserve cannot be negative")
        if self.kv_dtype not in KV_DTYPES:
            raise CallerError(Reason.INVALID_REQUEST, f"KV dtype must be one of {', '.join(KV_DTYPES)}")
        if self.seam_dtype.upper() not in DType.__members__:
            raise CallerError(Reason.INVALID_REQUEST, "seam dtype must be f32 or f16")

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["globals_need"] = self.globals_need.value
        return d
