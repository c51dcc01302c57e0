"""Where a node's range sits between one GPU and host memory, and what each llama.cpp buffer holds.

`place(layout, params, layers, gpu_layers)` prices a range loaded with
`--gpu-layers N` (dgr.backends.placement) buffer by buffer, named as
llama.cpp's load log names them: the device's ("GPU" here; "Vulkan0" or
"CUDA0" in the log) and the host's ("CPU"; the log's CPU_Mapped, CPU_REPACK,
CPU, or the device's pinned Vulkan_Host / CUDA_Host), each split into model,
KV and compute as the log reports them. `fit` takes the most slots whose GPU
bytes fit a node's GPU; `tables` does that for every range at once, for the
search.

llama.cpp's rules, read off the vendored llama.cpp with dgr's patch series
(src/llama-model.cpp load_tensors, src/llama-kv-cache.cpp and
llama-kv-cache-dsv4.cpp, src/llama-context.cpp, ggml/src/ggml-backend.cpp's
scheduler):
- Slots. `--gpu-layers N` counts a range's slots back from its end: the range
  holding the last layer counts its output first (output norm, LM head,
  DeepSeek-V4's hc_head), then its next-token-prediction (MTP) layers, then
  its own layers from the last; "all" is every slot. The token embedding
  stays in host memory (llama.cpp keeps the input layer on the CPU).
- Model. A slot on the GPU holds its tensors in the device's buffer, but with
  `--cpu-moe` its routed experts (ffn_*_exps) stay in host memory. A tied LM
  head on the GPU is a second copy of the token embedding, and a shared
  global (rope_freqs) is copied into each buffer that holds a layer.
- KV. A layer's caches (DeepSeek-V4's compressor states too) are where the
  layer is (offload_kqv, llama.cpp's default).
- Compute. Each backend reserves a buffer for its part of the graph at ubatch
  tokens. The GPU's is charged the model's compute rule (the activations of a
  ubatch: buffers are reused layer to layer, so a layer's peak is the
  graph's), plus an allowance for ggml's op offload wherever an op reads a
  weight from host memory: from a batch of 32 (GGML_OP_OFFLOAD_MIN_BATCH; the
  batch is a MUL_MAT's ne[1], a MUL_MAT_ID's ne[2], and never a GET_ROWS's)
  the scheduler (ggml_backend_sched_split_graph) runs the op on the GPU,
  starting a split at it whose input is a copy of the weight in the GPU's
  compute buffer. ggml-alloc allocates that copy as the op starts and frees it
  when the op ends, often in memory the activations left free (a tiny
  qwen3moe's --cpu-moe copies cost it nothing); and each such split moves the
  copies of the graph inputs read first after it (a later layer kind's mask,
  its indices) from the graph's start to the split's, which repacks
  ggml-alloc's best fit (a tiny deepseek4's buffer grew by ten times its
  expert copy). The bytes depend on that packing, so the allowance bounds
  them rather than predicting them: one copy of the largest such weight (the
  op's moment), plus the graph's inputs once more (what the moved copies can
  displace, each at most its own bytes: a reckoning, as best fit promises no
  tighter bound; tests_gpu/test_plan_buffers.py holds llama.cpp's log to it).
  The host's is charged the whole rule while any slot stays there, else only
  the graph's inputs (host_input_bytes).
- Output. The output buffer (hidden states or logits out) is host memory.

Left out: several GPUs in one node (llama.cpp's tensor split); the device's
own context, an allowance (PlanParams.gpu_reserve_bytes) rather than a rule;
among the graph's inputs, M-RoPE's four positions a token (one is counted)
and the Hadamard matrices of a quantized K cache;
and mmap's view of the file: llama.cpp reports host weights as the mapped span
of the file (CPU_Mapped), which also covers GPU tensors lying between host
ones, pages read once at load. The plan charges the tensors held.
"""

from __future__ import annotations

import re
from typing import Any

import attrs
import numpy as np

from dgr.artifact.constants import GlobalNeed
from dgr.backends.base import LayerRange
from dgr.backends.placement import CPU_MOE_PATTERN
from dgr.gguf_meta import Role, layer_of
from dgr.plan.layout import KvTerm, ModelLayout
from dgr.plan.params import PlanParams

__all__ = [
    "GPU_BUFFER",
    "HOST_BUFFER",
    "OP_OFFLOAD_MIN_BATCH",
    "Buffers",
    "GpuPlacement",
    "fit",
    "host_input_bytes",
    "is_cpu_moe_tensor",
    "is_lookup_tensor",
    "place",
    "tables",
]

GPU_BUFFER, HOST_BUFFER = "GPU", "CPU"

# ggml's scheduler hands an op whose weight is in host memory to the GPU from this batch on
# (ggml-vulkan.cpp and ggml-cuda.cu: GGML_OP_OFFLOAD_MIN_BATCH, default 32)
OP_OFFLOAD_MIN_BATCH = 32

_CPU_MOE = re.compile(CPU_MOE_PATTERN.decode())


def is_cpu_moe_tensor(name: str) -> bool:
    """A routed-expert tensor, which `--cpu-moe` keeps in host memory (dgr.backends.placement's pattern)."""
    return _CPU_MOE.search(name) is not None


def is_lookup_tensor(name: str) -> bool:
    """A table read one row per token (GET_ROWS), never copied to the GPU: the token embedding, DeepSeek-V4's
    hash-routing table."""
    return "tid2eid" in name or name.startswith("token_embd.")


@attrs.frozen
class Buffers:
    """The bytes of one buffer type, split as llama.cpp's load log reports them."""

    model: int = 0
    kv: int = 0
    compute: int = 0
    output: int = 0  # host only: the range's hidden states or logits out

    @property
    def total(self) -> int:
        return self.model + self.kv + self.compute + self.output

    def to_json(self) -> dict[str, int]:
        return {"model": self.model, "KV": self.kv, "compute": self.compute, "output": self.output}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Buffers:
        return cls(int(d["model"]), int(d["KV"]), int(d["compute"]), int(d["output"]))


@attrs.frozen
class GpuPlacement:
    """A range loaded with its last `gpu_layers` slots on the GPU, and the bytes of each buffer."""

    gpu_layers: int  # slots on the GPU, counted back from the range's end (llama.cpp's n_gpu_layers)
    slots: int  # every slot of the range: its layers, and on the tail its MTP layers and the output
    on_gpu: tuple[int, ...]  # llama.cpp's layer indices on the GPU, ascending; the output is the last index
    output_on_gpu: bool
    cpu_moe: bool
    gpu: Buffers
    cpu: Buffers
    reserve_bytes: int  # the device's own context (PlanParams.gpu_reserve_bytes); 0 when no slot offloads

    @property
    def flag(self) -> str:
        """The `--gpu-layers` value to start the node with."""
        return "all" if self.gpu_layers and self.gpu_layers == self.slots else str(self.gpu_layers)

    @property
    def gpu_used(self) -> int:
        return self.gpu.total + self.reserve_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu_layers": self.flag, "slots": self.slots, "on_gpu": list(self.on_gpu),
            "output_on_gpu": self.output_on_gpu, "cpu_moe": self.cpu_moe, "reserve_bytes": self.reserve_bytes,
            "buffers": {GPU_BUFFER: self.gpu.to_json(), HOST_BUFFER: self.cpu.to_json()},
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GpuPlacement:
        slots = int(d["slots"])
        return cls(
            gpu_layers=slots if d["gpu_layers"] == "all" else int(d["gpu_layers"]), slots=slots,
            on_gpu=tuple(int(i) for i in d["on_gpu"]), output_on_gpu=bool(d["output_on_gpu"]),
            cpu_moe=bool(d["cpu_moe"]), gpu=Buffers.from_json(d["buffers"][GPU_BUFFER]),
            cpu=Buffers.from_json(d["buffers"][HOST_BUFFER]), reserve_bytes=int(d["reserve_bytes"]),
        )  # fmt: skip


# -- the slots of a range, from its end -------------------------------------------------------------


@attrs.frozen
class _Slots:
    """A range's slots as arrays, in llama.cpp's offload order (from the range's end), and what stays put."""

    index: np.ndarray  # llama.cpp's layer index of each slot
    model: np.ndarray  # tensor bytes
    experts: np.ndarray  # of which routed experts
    kv: np.ndarray
    largest: np.ndarray  # its largest tensor an op reads as a weight
    largest_expert: np.ndarray
    is_layer: np.ndarray  # a layer (trunk or MTP), not the output
    host: int  # tensors in host memory wherever the slots go: the token embedding, a derived file's globals
    shared: int  # globals every layer's buffer holds a copy of (rope_freqs)
    dup: int  # a tied embedding held as input and as output: one copy while both are in host memory
    tail: bool


def _slots(layout: ModelLayout, params: PlanParams, layers: LayerRange) -> _Slots:
    is_head, is_tail = layers.start == 0, layers.stop == layout.n_layers
    loader = params.globals_need is GlobalNeed.LOADER
    host = shared = dup = 0
    out: list[tuple[int, int]] = []  # (bytes, largest) of the output's tensors
    mtp: dict[int, list[tuple[str, int]]] = {}
    for g in layout.globals:
        il = layer_of(g.name)
        if is_tail and il is not None and g.role is Role.TAIL:
            mtp.setdefault(il, []).append((g.name, g.n_bytes))
        elif is_tail and g.role in (Role.TAIL, Role.HEAD_TAIL):
            out.append((g.n_bytes, g.n_bytes))
            if g.role is Role.HEAD_TAIL and is_head:
                host, dup = host + g.n_bytes, dup + g.n_bytes
        elif g.role is Role.SHARED:
            shared += g.n_bytes
        elif g.needed_by(is_head=is_head, is_tail=is_tail) or (loader and il is None):
            host += g.n_bytes
    rows: list[tuple[int, int, int, int, int, int, bool]] = []  # index, model, experts, kv, largest, l_exp, layer
    if is_tail:
        n_all = max(mtp, default=layout.n_layers - 1) + 1
        rows.append((n_all, sum(b for b, _ in out), 0, 0, max((x for _, x in out), default=0), 0, False))
        for il in sorted(mtp, reverse=True):
            ts = mtp[il]
            exps = [b for n, b in ts if is_cpu_moe_tensor(n)]
            rows.append((il, sum(b for _, b in ts), sum(exps), 0,
                         max((b for n, b in ts if not is_lookup_tensor(n)), default=0), max(exps, default=0), True))
    for layer in reversed(layout.layers[layers.start : layers.stop]):
        kv = layer.kv_bytes(params.context, params.sessions, params.kv_dtype, params.ubatch, params.swa_full)
        rows.append((layer.index, layer.weight_bytes, layer.expert_bytes, kv, layer.largest_bytes,
                     layer.largest_expert_bytes, True))
    cols = [np.array(c, dtype=np.int64) for c in zip(*rows)]
    return _Slots(*cols[:6], cols[6].astype(bool), host=host, shared=shared, dup=dup, tail=is_tail)


# the architectures whose indexer caches llama.cpp rotates (llama-kv-cache.cpp: a Hadamard matrix per cache)
_ROTATED_INDEXERS = frozenset({"deepseek32", "deepseek4", "glm-dsa", "dots3note"})


def _rotation_bytes(head: int) -> int:
    """The f32 Hadamard matrix llama.cpp rotates a cache's `head`-wide keys with (build_input_k_rot): the
    largest power of two from 128 up dividing the head, else 64, square."""
    n = 128
    while head % n == 0:
        n *= 2
    return 4 * (n // 2) ** 2


def host_input_bytes(layout: ModelLayout, params: PlanParams, layers: LayerRange) -> int:
    """The graph's inputs, which stay in host memory when every slot of the range is on the GPU.

    Per ubatch position (llama-graph.cpp, llama-kv-cache.cpp, dgr's flash attention off):
    - the range's input row, f32: a head allocates the embeddings input (inp_embd, for a batch of
      embeddings) and the token embedding's lookup output too, since the lookup runs where the table is
      (host memory) and ggml never offloads a GET_ROWS; a later range takes the seam's hidden states;
    - i32 ids: the position, the token (a head, or layers that read token ids), the output (a tail);
    - per cache (a full one, a window, each DeepSeek-V4 compressed cache; an indexer's is its own): its
      mask, a row as wide as its cells (f32; an indexer's f16, the fused lightning indexer's); its slot,
      an i64 (a compressed cache's state positions and read and write slots instead, about 16 bytes); and
      with a V cache, stored transposed without flash attention, an i64 per value of the widest V row.
    Besides: the Hadamard matrices of a DeepSeek indexer's cache, and of each other cache whose keys are
    the indexer's width.
    """
    u, is_head, is_tail = params.ubatch, layers.start == 0, layers.stop == layout.n_layers
    per_pos = 4 * (2 * layout.hidden_size if is_head else layout.seam_width)
    per_pos += 4 * (1 + int(is_head or layout.needs_token_ids) + int(is_tail))
    caches: dict[tuple[int, int, bool], list[KvTerm]] = {}  # K and V of a cache share its inputs
    for layer in layout.layers[layers.start : layers.stop]:
        for t in layer.kv:
            if not t.fixed:
                caches.setdefault((t.every, t.window, t.name.startswith("indexer")), []).append(t)
    # llama.cpp's n_embd_v_gqa_max: the widest V row of any layer of the model, not only the range's
    v_width = max((t.width for layer in layout.layers for t in layer.kv if t.name == "v"), default=0)
    indexer = next((ts[0].width for (_, _, is_indexer), ts in caches.items() if is_indexer), 0)
    rotated = 0
    for (every, _, is_indexer), ts in caches.items():
        per_pos += ts[0].rows(params.context, u, params.swa_full) * (2 if is_indexer else 4)
        per_pos += 16 if every > 1 else 8
        per_pos += 8 * v_width if any(t.name == "v" for t in ts) else 0
        if layout.architecture in _ROTATED_INDEXERS and indexer and (is_indexer or ts[0].width == indexer):
            rotated += _rotation_bytes(ts[0].width)
    return u * per_pos + rotated


# -- pricing every placement of a range at once -------------------------------------------------------


@attrs.frozen
class _Curves:
    """Each buffer's bytes for g = 0 .. slots slots on the GPU (arrays of slots + 1)."""

    slots: _Slots
    gpu_model: np.ndarray
    gpu_kv: np.ndarray
    gpu_compute: np.ndarray
    host_model: np.ndarray
    host_kv: np.ndarray
    host_compute: np.ndarray
    output: int
    reserve: np.ndarray

    @property
    def gpu_used(self) -> np.ndarray:
        return self.gpu_model + self.gpu_kv + self.gpu_compute + self.reserve

    @property
    def host_used(self) -> np.ndarray:
        return self.host_model + self.host_kv + self.host_compute + self.output


def _prefix(x: np.ndarray) -> np.ndarray:
    """[0, x0, x0 + x1, ...]: the sum over the first g slots, g = 0 .. len(x)."""
    return np.concatenate([[0], np.cumsum(x)]).astype(np.int64)


def _curves(layout: ModelLayout, params: PlanParams, layers: LayerRange) -> _Curves:
    s = _slots(layout, params, layers)
    n = len(s.model)
    g = np.arange(n + 1)
    moe = int(params.cpu_moe)
    layers_first = _prefix(s.is_layer.astype(np.int64))  # layers among the first g slots
    gpu_has_layer, host_has_layer = layers_first > 0, layers_first < layers_first[-1]
    model_first, experts_first, kv_first = _prefix(s.model), _prefix(s.experts), _prefix(s.kv)
    gpu_model = model_first - moe * experts_first + s.shared * gpu_has_layer
    host_model = (s.host + model_first[-1] - model_first + moe * experts_first + s.shared * host_has_layer
                  - s.dup * (s.tail & (g == 0)))  # fmt: skip
    rule = layout.compute.nbytes(params.context)
    # the largest host tensor an op reads as a weight: the slots left on the host, and with --cpu-moe the
    # experts of those on the GPU; copied into the GPU's compute buffer at a large enough batch
    host_largest = np.concatenate([np.maximum.accumulate(s.largest[::-1])[::-1], [0]])
    gpu_expert = np.concatenate([[0], np.maximum.accumulate(s.largest_expert)]) * moe
    copy = np.maximum(host_largest, gpu_expert) * (params.ubatch >= OP_OFFLOAD_MIN_BATCH)
    inputs = host_input_bytes(layout, params, layers)
    offload = np.where(copy > 0, copy + inputs, 0)  # the op-offload allowance (the module's Compute)
    return _Curves(
        slots=s,
        gpu_model=gpu_model,
        gpu_kv=kv_first,
        gpu_compute=np.where(g > 0, rule + offload, 0),
        host_model=host_model,
        host_kv=kv_first[-1] - kv_first,
        host_compute=np.where(g < n, rule, inputs),
        output=0 if s.tail else params.ubatch * layout.seam_width * 4,
        reserve=np.where(g > 0, params.gpu_reserve_bytes, 0),
    )


def _placement(c: _Curves, g: int, cpu_moe: bool) -> GpuPlacement:
    s = c.slots
    return GpuPlacement(
        gpu_layers=g,
        slots=len(s.model),
        on_gpu=tuple(sorted(int(i) for i in s.index[:g])),
        output_on_gpu=bool(s.tail and g > 0),
        cpu_moe=cpu_moe and g > 0,
        gpu=Buffers(int(c.gpu_model[g]), int(c.gpu_kv[g]), int(c.gpu_compute[g])),
        cpu=Buffers(int(c.host_model[g]), int(c.host_kv[g]), int(c.host_compute[g]), c.output),
        reserve_bytes=int(c.reserve[g]),
    )


def place(layout: ModelLayout, params: PlanParams, layers: LayerRange, gpu_layers: int) -> GpuPlacement:
    """`layers` loaded with `--gpu-layers gpu_layers` (-1: all) and, with params.cpu_moe, `--cpu-moe`."""
    c = _curves(layout, params, layers)
    n = len(c.slots.model)
    return _placement(c, n if gpu_layers < 0 else min(gpu_layers, n), params.cpu_moe)


def _best(c: _Curves, gpu_bytes: int) -> int:
    """The most slots whose GPU bytes fit `gpu_bytes` (0 always does: no device at all)."""
    fits = np.flatnonzero(c.gpu_used <= gpu_bytes)
    return int(fits[-1]) if len(fits) else 0


def fit(layout: ModelLayout, params: PlanParams, layers: LayerRange, gpu_bytes: int) -> GpuPlacement:
    """The placement of `layers` with the most slots on a GPU of `gpu_bytes` (the fewer left on the host, the
    less host memory the range needs: every other buffer only moves to the GPU)."""
    c = _curves(layout, params, layers)
    return _placement(c, _best(c, gpu_bytes), params.cpu_moe)


def tables(layout: ModelLayout, params: PlanParams, gpu_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """For every range [a, b) placed by `fit`: int64[a, b] of its host bytes (every host buffer, the runtime
    not included) and of the GPU memory left free; zeros where a >= b."""
    n = layout.n_layers
    host = np.zeros((n + 1, n + 1), dtype=np.int64)
    free = np.zeros((n + 1, n + 1), dtype=np.int64)
    for a in range(n):
        for b in range(a + 1, n + 1):
            c = _curves(layout, params, LayerRange(a, b))
            g = _best(c, gpu_bytes)
            host[a, b], free[a, b] = c.host_used[g], gpu_bytes - c.gpu_used[g]
    return host, free
