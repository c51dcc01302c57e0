"""Make a backend by name. Heavy imports (torch, llama_cpp) happen only here, on demand."""

from __future__ import annotations

from pathlib import Path

from dgr.backends.base import LayerRange, ShardBackend
from dgr.backends.placement import Placement
from dgr.errors import CallerError, Reason

__all__ = ["BACKENDS", "make_backend", "model_layer_count", "resolve_model"]

BACKENDS = ("stub", "torch", "llama", "llama_shard")


def resolve_model(backend: str, model: str | None) -> Path | None:
    """The GGUF path a backend will load: --model, or the embedded default."""
    if backend == "stub":
        return None
    from dgr.models import check_gguf_file, default_model_path

    return check_gguf_file(model) if model else default_model_path()


def model_layer_count(backend: str, model: Path | None, stub_model: str = "default") -> int:
    if backend == "stub":
        from dgr.backends.stub import DEEPSEEK_LIKE, StubSpec

        return (DEEPSEEK_LIKE if stub_model == "dsv4" else StubSpec()).n_layers
    # ggml's own GGUF parser: milliseconds, where gguf-py's reader takes seconds on a large vocabulary
    from dgr.gguf_meta import read_header

    header = read_header(model)
    if not header.n_layer:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"{model} has no {header.architecture}.block_count")
    return int(header.n_layer)


def make_backend(
    name: str,
    layers: LayerRange | None,
    model: Path | None,
    *,
    threads: int = 1,
    n_ctx: int = 4096,
    max_sessions: int = 8,
    stub_delay_s: float = 0.0,
    stub_model: str = "default",
    placement: Placement = Placement(),
) -> ShardBackend:
    """`placement`: where a llama.cpp backend puts its layers (dgr.backends.placement); the others compute on the CPU.

    Raises: CallerError(INVALID_REQUEST | MODEL_LOAD_FAILED)."""
    n_layers = model_layer_count(name, model, stub_model)
    layers = layers or LayerRange(0, n_layers)
    if layers.stop > n_layers:
        raise CallerError(Reason.INVALID_REQUEST, f"layers {layers} exceed the model's {n_layers} layers")
    if placement.offloads and name not in ("llama", "llama_shard"):
        raise CallerError(Reason.INVALID_REQUEST, f"--gpu-layers is for the llama.cpp backends, not {name}",
                          param="gpu_layers")
    if name == "stub":
        from dgr.backends.stub import DEEPSEEK_LIKE, StubBackend, StubSpec

        spec = DEEPSEEK_LIKE if stub_model == "dsv4" else StubSpec()
        return StubBackend(spec=spec, layers=layers, delay_s=stub_delay_s, capacity=max_sessions, n_ctx=n_ctx)
    if name == "torch":
        from dgr.backends.torch_backend import TorchBackend

        return TorchBackend(model, layers, n_threads=threads, capacity=max_sessions)
    if name == "llama":
        from dgr.backends.llama import LlamaBackend

        if (layers.start, layers.stop) != (0, n_layers):
            raise CallerError(Reason.INVALID_REQUEST, "the llama backend serves the whole model; use llama_shard")
        return LlamaBackend(model, n_threads=threads, n_ctx=n_ctx, max_sessions=max_sessions, placement=placement)
    if name == "llama_shard":
        from dgr.backends.llama_shard import LlamaShardBackend

        return LlamaShardBackend(model, layers, n_threads=threads, n_ctx=n_ctx, max_sessions=max_sessions,
                                 placement=placement)
    raise CallerError(Reason.INVALID_REQUEST, f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
