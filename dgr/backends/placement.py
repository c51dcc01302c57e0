"""Where a llama.cpp node puts its range's tensors: the CPU, or a GPU (CUDA, Vulkan) beside it.

A range's own layers are offloaded by their global indices (the patch series counts `n_gpu_layers`
back from the range's end: llama/patches/0002): `--gpu-layers all` puts every layer of the range
on the device, `N` its last N; 0 none, and no device at all. The output head and the KV cache of offloaded layers go
where llama.cpp puts them for a whole model; the token embedding stays in host memory, as
llama.cpp keeps it. `--cpu-moe` keeps the routed experts of the range's layers in host memory
(llama.cpp's own `--cpu-moe` pattern), so a large MoE range fits a small card: attention, shared
experts and the KV cache on the GPU, the experts read from RAM. `--device` names the ggml device
(`Vulkan0`, `CUDA0`; a wrong name is refused with the devices the build sees); by default llama.cpp's own choice.

The hidden states between nodes are host float32 either way: ggml's scheduler copies a range's
input to its first layer's device and its output back, so the seam does not change.

Left out: loading (dgr.backends.llama_engine sets these parameters), planning memory per device
(dgr.plan).
"""

from __future__ import annotations

import ctypes
from typing import Any

import attrs

from dgr.errors import CallerError, Reason

__all__ = ["CPU_MOE_PATTERN", "Placement", "devices", "parse_gpu_layers"]

# llama.cpp's common/arg.cpp `--cpu-moe`: every routed expert tensor of every layer
CPU_MOE_PATTERN = rb"\.ffn_(up|down|gate|gate_up)_exps"
_GPU_TYPES = {1: "gpu", 2: "igpu"}  # enum ggml_backend_dev_type: CPU 0, GPU 1, IGPU 2, ACCEL 3


def parse_gpu_layers(text: str) -> int:
    """`--gpu-layers`: "all" (-1: every layer of the range), or a count from the range's end (0: none)."""
    if text == "all":
        return -1
    try:
        n = int(text)
    except ValueError:
        n = -2
    if n < 0:
        raise ValueError(f"--gpu-layers takes 'all' or a count of layers, not {text!r}")
    return n


class _Override(ctypes.Structure):
    """struct llama_model_tensor_buft_override: tensors whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


_DECLARED: list[Any] = []


def _ggml() -> Any:
    """libggml's device registry (libggml.so) and device calls (libggml-base.so), declared once."""
    if _DECLARED:
        return _DECLARED[0]
    from dgr.backends.clib import ggml_lib, llama_lib

    lib = llama_lib()  # loads libggml.so too, and registers the built backends
    reg = lib._lib  # the device registry's functions are visible through libllama's handle's dependencies
    base = ggml_lib()
    vp = ctypes.c_void_p
    for owner, name, args, res in [
        (reg, "ggml_backend_dev_count", [], ctypes.c_size_t),
        (reg, "ggml_backend_dev_get", [ctypes.c_size_t], vp),
        (reg, "ggml_backend_dev_by_name", [ctypes.c_char_p], vp),
        (reg, "ggml_backend_dev_by_type", [ctypes.c_int], vp),
        (base, "ggml_backend_dev_name", [vp], ctypes.c_char_p),
        (base, "ggml_backend_dev_description", [vp], ctypes.c_char_p),
        (base, "ggml_backend_dev_memory", [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
         None),
        (base, "ggml_backend_dev_type", [vp], ctypes.c_int),
        (base, "ggml_backend_dev_buffer_type", [vp], vp),
    ]:
        fn = getattr(owner, name)
        fn.argtypes, fn.restype = args, res
    _DECLARED.append((reg, base))
    return reg, base


def devices() -> list[dict[str, Any]]:
    """The accelerators this build of llama.cpp sees: name, description, kind, memory free and total (bytes).
    Empty on a CPU-only build (and where a Vulkan build sees only a software device it hides: lavapipe shows
    with GGML_VK_VISIBLE_DEVICES=0)."""
    reg, base = _ggml()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        kind = _GPU_TYPES.get(base.ggml_backend_dev_type(dev))
        if kind is None:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": base.ggml_backend_dev_name(dev).decode(), "kind": kind,
                    "description": base.ggml_backend_dev_description(dev).decode(),
                    "memory_free": free.value, "memory_total": total.value})
    return out


@attrs.frozen
class Placement:
    """A node's device choice: `gpu_layers` (-1: all of the range, N: its last N, 0: none), `device` (a ggml
    device name; None: llama.cpp's choice among what it sees), `cpu_moe` (routed experts in host memory)."""

    gpu_layers: int = 0
    device: str | None = None
    cpu_moe: bool = False

    @classmethod
    def per_node(cls, args: Any, nodes: int = 1) -> list[Placement]:
        """Each of `nodes` nodes' `--gpu-layers` (one value for all, or one per node, comma-separated, as `dgr up`
        takes them), with `--device` and `--cpu-moe` for those that offload.

        Raises: CallerError(INVALID_REQUEST): a value that is not 'all' or a count, a list of another length
        than the nodes, or --device or --cpu-moe where no node offloads.
        """
        values = str(getattr(args, "gpu_layers", "0")).split(",")
        if len(values) not in (1, nodes):
            raise CallerError(Reason.INVALID_REQUEST, f"--gpu-layers gives {len(values)} values for {nodes} nodes: "
                              "give one for all, or one per node", param="gpu_layers")
        try:
            counts = [parse_gpu_layers(values[i if len(values) > 1 else 0]) for i in range(nodes)]
        except ValueError as exc:
            raise CallerError(Reason.INVALID_REQUEST, str(exc), param="gpu_layers") from None
        device, cpu_moe = getattr(args, "device", None), bool(getattr(args, "cpu_moe", False))
        if (device is not None or cpu_moe) and not any(counts):
            raise CallerError(Reason.INVALID_REQUEST, "--device and --cpu-moe place what --gpu-layers puts on a GPU, "
                              "and --gpu-layers puts nothing there", param="gpu_layers")
        return [cls(n, device, cpu_moe) if n else cls() for n in counts]

    @property
    def offloads(self) -> bool:
        return self.gpu_layers != 0

    def devices_used(self) -> list[dict[str, Any]]:
        """The devices (as `devices()` reads them now) this placement may put layers on: none when it offloads
        nothing, the one `device` names, else every one the build sees (llama.cpp splits layers over them)."""
        if not self.offloads:
            return []
        return [d for d in devices() if self.device in (None, d["name"])]

    def to_json(self) -> dict[str, Any]:
        return {"gpu_layers": "all" if self.gpu_layers < 0 else self.gpu_layers, "device": self.device,
                "cpu_moe": self.cpu_moe}

    def apply(self, mparams: Any) -> list[Any]:
        """Set `mparams` (a llama_model_params) to place the range so; returns the C arrays it points to, for the
        caller to hold until the model is loaded.

        Raises:
            CallerError(INVALID_REQUEST): a GPU asked of a build that sees none, or a device it does not have;
            the message says how to get a GPU build.
        """
        mparams.n_gpu_layers = self.gpu_layers
        if not self.offloads:
            # no device at all, not only no layer: else a GPU build's device still takes large batches' matmuls
            # (llama.cpp's op offload)
            none = (ctypes.c_void_p * 1)(None)
            mparams.devices = ctypes.cast(none, ctypes.c_void_p)
            return [none]
        seen = devices()
        if not seen:
            raise CallerError(Reason.INVALID_REQUEST, "--gpu-layers asks for a GPU, and this llama.cpp build sees none: "
                              "install a GPU build with `make install GPU=cuda` or `make install GPU=vulkan` (a "
                              "software Vulkan device shows with GGML_VK_VISIBLE_DEVICES=0)", param="gpu_layers")
        keep: list[Any] = []
        reg, base = _ggml()
        if self.device is not None:
            if self.device not in {d["name"] for d in seen}:
                raise CallerError(Reason.INVALID_REQUEST, f"no device {self.device!r}: this build sees "
                                  f"{', '.join(d['name'] for d in seen)}", param="device")
            chosen = (ctypes.c_void_p * 2)(reg.ggml_backend_dev_by_name(self.device.encode()), None)
            mparams.devices = ctypes.cast(chosen, ctypes.c_void_p)
            keep.append(chosen)
        if self.cpu_moe:
            cpu = base.ggml_backend_dev_buffer_type(reg.ggml_backend_dev_by_type(0))
            overrides = (_Override * 2)(_Override(CPU_MOE_PATTERN, cpu), _Override(None, None))
            mparams.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
            keep.append(overrides)
        return keep
