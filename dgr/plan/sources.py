"""Where layouts come from: a GGUF header, a layout JSON, or a Model Artifact manifest.

Three sources give the same layout, all through `build_layout`:
- a GGUF file, header only (dgr.gguf_meta.read_header: no tensor data is read);
- a layout JSON (`format: dgr-layout/1`), which describes tensors per layer
  group with a quantization recipe, so a 284B model needs no file at all
  (tests/fixtures/deepseek-v4-flash.layout.json is one);
- a Model Artifact manifest (`layout_from_manifest`).

Tensor names and global roles are dgr.gguf_meta's, the same answer the
manifest gets; KV and split rules are dgr.plan.rules'.

Left out: the plan itself (dgr.plan.search), and any tensor data.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dgr.artifact.constants import MANIFEST_KIND
from dgr.errors import CallerError, Reason
from dgr.gguf_meta import (
    ARCHITECTURE_KEY,
    NAME_KEY,
    RECURRENT_HYBRID_ARCHS,
    Role,
    global_role,
    is_tied,
    layer_of,
    metadata,
    read_header,
)
from dgr.plan.gpu import is_cpu_moe_tensor, is_lookup_tensor
from dgr.plan.layout import (
    LAYOUT_FORMAT,
    ComputeRule,
    GlobalTensor,
    KvTerm,
    LayerInfo,
    ModelLayout,
    TensorInfo,
    tensor_nbytes,
)
from dgr.plan.rules import (
    compute_rule_from_anchors,
    gguf_compute_rule,
    kv_terms_for_layer,
    meta_int,
)

__all__ = [
    "build_layout",
    "layout_from_gguf",
    "layout_from_json",
    "layout_from_manifest",
    "load_layout",
]


_ROUTED = re.compile(r"_exps?\.")  # stacked routed-expert tensors (ffn_*_exps)


def _active_bytes(t: TensorInfo, used_share: float) -> int:
    """Bytes of `t` one decode token reads: routed experts in their used share, lookup tables not at all."""
    if _ROUTED.search(t.name + "."):
        return int(t.n_bytes * used_share)
    if is_lookup_tensor(t.name):
        return 0  # one row per token
    return t.n_bytes


def build_layout(
    *,
    name: str,
    arch: str,
    meta: Mapping[str, Any],
    tensors: Iterable[TensorInfo],
    compute: ComputeRule,
    source: str,
    recipe: str | None = None,
    kv_override: Mapping[str, tuple[KvTerm, ...]] | None = None,
) -> ModelLayout:
    """Group tensors by layer and price each layer's KV. The one path every source takes.

    `blk.N.*` tensors belong to layer N; DeepSeek-V4's next-token-prediction
    layers (N >= block_count - nextn_predict_layers) are charged to the tail.
    `kv_override` maps a layer kind to explicit KV terms (a layout JSON may
    carry them); otherwise they come from `kv_terms_for_layer`.

    Raises:
        CallerError(MODEL_LOAD_FAILED): metadata or tensors do not describe the layers.
    """
    p = f"{arch}."
    n_all = meta_int(meta, p + "block_count")
    n_trunk = n_all - int(meta.get(p + "nextn_predict_layers", 0) or 0)
    n_embd = meta_int(meta, p + "embedding_length")
    hc = int(meta.get(p + "hyper_connection.count", 1) or 1)
    n_expert = int(meta.get(p + "expert_count", 0) or 0)
    used_share = int(meta.get(p + "expert_used_count", 0) or 0) / n_expert if n_expert else 1.0

    tensors = list(tensors)
    tied = is_tied(t.name for t in tensors)
    per_layer: list[list[TensorInfo]] = [[] for _ in range(n_trunk)]
    globals_: list[GlobalTensor] = []
    vocab = 0
    for t in tensors:
        if t.name.startswith("token_embd."):
            vocab = t.shape[1] if len(t.shape) > 1 else 0
        il = layer_of(t.name)
        if il is None:
            role = global_role(t.name, tied=tied, arch=arch)
            # The head only looks up one embedding row per token; everything else is read whole
            # (tied embeddings are the tail's LM head).
            active = 0 if role is Role.HEAD else t.n_bytes
            globals_.append(GlobalTensor(t.name, t.n_bytes, role, active))
            continue
        if il >= n_all:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"tensor {t.name} is beyond block_count {n_all}")
        if il >= n_trunk:
            globals_.append(GlobalTensor(t.name, t.n_bytes, Role.TAIL, _active_bytes(t, used_share)))
            continue
        per_layer[il].append(t)

    layers = []
    for il, ts in enumerate(per_layer):
        if not ts:
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"layer {il} of {name} has no tensors")
        kind, kv = kv_terms_for_layer(arch, meta, il, ts)
        if kv_override is not None and kind in kv_override:
            kv = kv_override[kind]
        experts = [t.n_bytes for t in ts if is_cpu_moe_tensor(t.name)]
        layers.append(
            LayerInfo(
                index=il,
                kind=kind,
                weight_bytes=sum(t.n_bytes for t in ts),
                active_bytes=sum(_active_bytes(t, used_share) for t in ts),
                kv=kv,
                expert_bytes=sum(experts),
                largest_bytes=max((t.n_bytes for t in ts if not is_lookup_tensor(t.name)), default=0),
                largest_expert_bytes=max(experts, default=0),
            )
        )
    return ModelLayout(
        name=name,
        architecture=arch,
        n_layers=n_trunk,
        hidden_size=n_embd,
        seam_width=hc * n_embd,
        hash_layers=int(meta.get(p + "hash_layer_count", 0) or 0),
        vocab_size=int(meta.get(p + "vocab_size", 0) or vocab),
        context_length=int(meta.get(p + "context_length", 0) or 0),
        layers=tuple(layers),
        globals=tuple(globals_),
        compute=compute,
        source=source,
        recipe=recipe,
        shard_starts=frozenset(layer.index for layer in layers if layer.kind == "full")
        if arch == "glm-dsa"
        else None,
    )


# -- sources ----------------------------------------------------------------------


def layout_from_gguf(path: str | Path) -> ModelLayout:
    """Read a GGUF's header (metadata and tensor table) into a layout. No tensor data is read.

    Raises:
        CallerError(MODEL_LOAD_FAILED): not a readable GGUF, or metadata missing.
    """
    p = Path(path)
    header = read_header(p)
    meta = metadata(header)  # the vocabulary arrays are large and the planner needs none of them
    arch = meta.get(ARCHITECTURE_KEY)
    if not arch:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"GGUF has no {ARCHITECTURE_KEY}: {p}")
    tensors = [
        TensorInfo(t.name, t.type, t.shape, t.n_bytes) for t in header.tensors
    ]
    vocab = next((t.shape[1] for t in tensors if t.name.startswith("token_embd.")), 0)
    return build_layout(
        name=str(meta.get(NAME_KEY) or p.stem),
        arch=str(arch),
        meta=meta,
        tensors=tensors,
        compute=gguf_compute_rule(str(arch), meta, vocab),
        source=str(p),
    )


def _expand_layers(spec: Any, n_layers: int) -> list[int | None]:
    """A tensor group's layers: "all", "global", or a list of layer indices."""
    if spec == "global":
        return [None]
    if spec == "all":
        return list(range(n_layers))
    return [int(i) for i in spec]


def layout_from_json(data: Mapping[str, Any], *, recipe: str | None = None, source: str = "<json>") -> ModelLayout:
    """A `dgr-layout/1` description (tensors per layer group, priced by a recipe), or a manifest.

    The layout format:
      metadata       GGUF metadata keys the planner reads ({arch}.block_count, ...)
      tensor_groups  [{layers: "all" | "global" | [i, ...], tensors: [{name, shape, role}]}]
                     names use "{i}" for the layer index; shapes are ggml order
      recipes        {name: {types: {role: ggml type}}}: one quantization of the model
      default_recipe which recipe to price when none is asked for
      kv.kinds       optional explicit KV terms per layer kind (checked against the code)
      compute        {anchors: [[context, bytes], [context, bytes]], source}: a linear rule

    Raises:
        CallerError(INVALID_REQUEST | MODEL_LOAD_FAILED)
    """
    fmt = data.get("format")
    if fmt != LAYOUT_FORMAT:
        if data.get("kind") == MANIFEST_KIND:
            return layout_from_manifest(data)
        raise CallerError(Reason.INVALID_REQUEST, f"not a {LAYOUT_FORMAT} layout or a {MANIFEST_KIND} manifest")
    try:
        return _layout_from_json(data, recipe, source)
    except (KeyError, TypeError, ValueError) as exc:
        raise CallerError(
            Reason.INVALID_REQUEST, f"layout {source}: a field is missing or malformed: {exc!r}"
        ) from None


def _layout_from_json(data: Mapping[str, Any], recipe: str | None, source: str) -> ModelLayout:
    arch = str(data["architecture"])
    meta = dict(data["metadata"])
    recipes = data.get("recipes", {})
    name = recipe or data.get("default_recipe")
    if name not in recipes:
        raise CallerError(
            Reason.INVALID_REQUEST, f"unknown recipe {name!r}; this layout has: {', '.join(sorted(recipes))}"
        )
    types: Mapping[str, str] = recipes[name]["types"]
    n_all = meta_int(meta, f"{arch}.block_count")
    tensors: list[TensorInfo] = []
    for group in data["tensor_groups"]:
        for il in _expand_layers(group["layers"], n_all):
            for t in group["tensors"]:
                role = t["role"]
                if role not in types:
                    raise CallerError(Reason.INVALID_REQUEST, f"recipe {name!r} gives no type for role {role!r}")
                tname = t["name"].format(i=il) if il is not None else t["name"]
                tensors.append(
                    TensorInfo(tname, types[role], tuple(t["shape"]), tensor_nbytes(types[role], t["shape"]))
                )
    compute = data.get("compute")
    if compute:
        rule = compute_rule_from_anchors(compute["anchors"], str(compute.get("source", "")))
    else:
        rule = ComputeRule(0, 0.0, "none given")
    kv_override = None
    if "kv" in data and "kinds" in data["kv"]:
        kv_override = {k: tuple(KvTerm.from_json(t) for t in ts) for k, ts in data["kv"]["kinds"].items()}
    return build_layout(
        name=str(data.get("name", source)),
        arch=arch,
        meta=meta,
        tensors=tensors,
        compute=rule,
        source=source,
        recipe=name,
        kv_override=kv_override,
    )


# Architectures whose KV the planner derives from GGUF metadata a manifest does not carry.
_METADATA_KV_ARCHS = {
    "deepseek4": "window, compression ratios",
    "glm-dsa": "kv_lora_rank, indexer roles",
    **{a: "recurrent layers, ssm sizes" for a in RECURRENT_HYBRID_ARCHS},
}


def layout_from_manifest(data: Mapping[str, Any]) -> ModelLayout:
    """A Model Artifact manifest (dgr.artifact.manifest, schema 1) as a layout.

    The manifest is checked (Manifest.from_json) and gives the model identity
    and every tensor's name, ggml type, shape and size: enough for weights
    and, through attn_k / attn_v shapes, for full-attention KV. It carries
    no other GGUF metadata, so architectures whose KV needs more (deepseek4:
    its window and compression ratios; glm-dsa: its MLA rank and indexer
    roles; Qwen3.5: its recurrent layers) are refused; plan those from the
    GGUF or a layout JSON.

    Raises:
        CallerError(ARTIFACT_MISMATCH): not a valid manifest.
        CallerError(MODEL_LOAD_FAILED): the architecture needs metadata a manifest lacks.
    """
    from dgr.artifact.manifest import (
        Manifest,  # deferred: the artifact plane is not needed to plan a GGUF
    )

    m = Manifest.from_json(data)
    arch = m.model.architecture
    if arch in _METADATA_KV_ARCHS:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            f"a manifest has no {arch} attention metadata ({_METADATA_KV_ARCHS[arch]}); "
            "plan this model from its GGUF or a layout JSON",
        )
    p = f"{arch}."
    meta = {
        "general.architecture": arch,
        p + "block_count": m.model.block_count,
        p + "embedding_length": m.model.hidden_size,
        p + "vocab_size": m.model.vocab_size,
        p + "context_length": m.model.context_length,
    }
    tensors = [TensorInfo(t.name, t.type, t.shape, t.size) for t in m.tensors]
    return build_layout(
        name=m.model.name or arch,
        arch=arch,
        meta=meta,
        tensors=tensors,
        compute=gguf_compute_rule(arch, meta, m.model.vocab_size),
        source=f"manifest {m.id[:12]} of {m.file.name}",
    )


def load_layout(path: str | Path, *, recipe: str | None = None) -> ModelLayout:
    """A layout from a GGUF file or a layout/manifest JSON file, chosen by content.

    Raises:
        CallerError(MODEL_LOAD_FAILED | INVALID_REQUEST)
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read {p}: {exc.strerror}") from None
    if head == b"GGUF":
        if recipe is not None:
            raise CallerError(Reason.INVALID_REQUEST, "--recipe applies to a layout JSON, not a GGUF file")
        return layout_from_gguf(p)
    try:
        data = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"{p} is neither GGUF nor JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CallerError(Reason.INVALID_REQUEST, f"{p}: a layout or manifest is a JSON object")
    return layout_from_json(data, recipe=recipe, source=str(p))
