"""The llama.cpp shard backend: layers [a, b) of a GGUF model on one node.

The node loads its range straight from the user's file (or from the pieces
of it the artifact plane fetched, at their offsets) through the layer-range
API of dgr's patched libllama (dgr.backends.clib): no derived file is
written, and only the range's tensors are mapped and read.
- head (a == 0): token ids in; others: float32 hidden states [n, W] in, the
  residual stream entering layer a;
- non-tail (b < n): hidden states [n, W] out, the residual stream after
  layer b-1, with no output norm, LM head or logits buffer;
- tail (b == n): logits of the last position out.

ModelInfo is that of the source model, digest included, so every shard of
one model agrees with each other and with `LlamaBackend`.
"""

from __future__ import annotations

from pathlib import Path

from dgr.backends.base import LayerRange
from dgr.backends.llama import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_N_CTX,
    LlamaCppBackend,
    check_header,
    default_threads,
)
from dgr.backends.llama_arch import shard_rule
from dgr.backends.clib import range_api
from dgr.backends.llama_engine import DEFAULT_N_BATCH
from dgr.backends.placement import Placement
from dgr.gguf_meta import GgufHeader
from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

__all__ = ["LlamaShardBackend", "check_shard_ranges"]


def check_shard_ranges(model: str | Path, ranges: list[LayerRange]) -> GgufHeader:
    """The model's header, if every range of `ranges` may run as a shard.

    `dgr up` calls this before it starts any process; each node again at start.

    Raises:
        CallerError(MODEL_LOAD_FAILED): unreadable file, an architecture
        refused or not certified for ranges (the message names it and why), a
        range past the last layer, or a libllama without the layer-range API.
    """
    source = check_gguf_file(model)
    header = check_header(source)
    shard_rule(header.architecture)
    for layers in ranges:
        if layers.stop > header.n_layer:
            raise CallerError(
                Reason.MODEL_LOAD_FAILED, f"layer range {layers} does not fit the {header.n_layer} layers of {source}"
            )
    if any(r != LayerRange(0, header.n_layer) for r in ranges):
        range_api()  # refuses a stock llama-cpp-python build, saying how to get the patched one
    return header


class LlamaShardBackend(LlamaCppBackend):
    """Layers [layers.start, layers.stop) of a GGUF model in one llama.cpp context."""

    name = "llama_shard"

    def __init__(
        self,
        model: str | Path,
        layers: LayerRange,
        *,
        n_threads: int | None = None,
        n_ctx: int = DEFAULT_N_CTX,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        n_batch: int = DEFAULT_N_BATCH,
        name: str | None = None,
        placement: Placement = Placement(),
    ) -> None:
        """Load `layers` of `model` through the layer-range API, on the devices `placement` names (its
        `gpu_layers` count from the range's end: dgr.backends.placement).

        Use the same n_batch on every stage of a route: it decides how a
        prefill is split, and so the exact float sums.

        Raises:
            CallerError(MODEL_LOAD_FAILED): the file is missing, unreadable,
            not GGUF, of an architecture refused or not certified for ranges
            (dgr.backends.llama_arch; the message names it and why), the
            range does not fit its layers, the installed libllama lacks the
            layer-range API, or llama.cpp refused the range.
        """
        source = check_gguf_file(model).resolve()
        header = check_shard_ranges(source, [layers])
        self._setup(
            source,
            header,
            layers,
            n_threads=n_threads or default_threads(),
            n_ctx=n_ctx,
            max_sessions=max_sessions,
            n_batch=n_batch,
            name=name,
            placement=placement,
        )
