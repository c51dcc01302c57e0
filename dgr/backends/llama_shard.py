"""The llama.cpp shard backend: layers [a, b) of a GGUF model on one node.

The node loads a shard GGUF derived from the user's file (dgr.backends.shardfile,
cached by the source's sha256) into a LlamaEngine:
- head (a == 0): token ids in; others: float32 hidden states [n, W] in;
- non-tail (b < n): hidden states [n, W] out, the residual stream after
  layer b-1, with the output norm and LM head skipped (the engine stops the
  graph early);
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
from dgr.backends.llama_arch import ShardRule, check_split, shard_rule
from dgr.backends.llama_engine import DEFAULT_N_BATCH, GgufHeader
from dgr.backends.shardfile import shard_path
from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

__all__ = ["LlamaShardBackend", "check_shard_ranges"]


def check_shard_ranges(model: str | Path, ranges: list[LayerRange]) -> tuple[GgufHeader, ShardRule]:
    """The model's header and range rule, if every range of `ranges` may run as a shard.

    `dgr up` calls this before it starts any process; each node again at start.

    Raises:
        CallerError(MODEL_LOAD_FAILED): unreadable file, an architecture not
        proven for ranges (the message names it and what is missing), a range
        past the last layer, or one that changes a size-typed hparam.
    """
    source = check_gguf_file(model)
    header = check_header(source)
    rule = shard_rule(header.architecture, nextn_layers=header.nextn_layers)
    for layers in ranges:
        if layers.stop > header.n_layer:
            raise CallerError(
                Reason.MODEL_LOAD_FAILED, f"layer range {layers} does not fit the {header.n_layer} layers of {source}"
            )
        check_split(
            rule, header.n_layer, layers.start, layers.stop,
            n_embd=header.n_embd, n_head=header.n_head, head_dim=header.head_dim,
        )
    return header, rule


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
        cache_root: Path | None = None,
    ) -> None:
        """Derive (or reuse) the shard file for `layers` of `model` and load it.

        Use the same n_batch on every stage of a route: it decides how a
        prefill is split, and so the exact float sums.

        Raises:
            CallerError(MODEL_LOAD_FAILED): the file is missing, unreadable,
            not GGUF, of an architecture not proven for ranges
            (dgr.backends.llama_arch; the message names it and what is
            missing), the range does not fit its layers, or llama.cpp refused
            the shard.
        """
        source = check_gguf_file(model).resolve()
        header, rule = check_shard_ranges(source, [layers])
        whole = layers == LayerRange(0, header.n_layer)
        engine_file = source if whole else shard_path(source, layers, root=cache_root)
        self._setup(
            source,
            header,
            layers,
            engine_file,
            n_threads=n_threads or default_threads(),
            n_ctx=n_ctx,
            max_sessions=max_sessions,
            n_batch=n_batch,
            name=name,
            rule=rule,
        )
