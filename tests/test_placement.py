"""A node's device placement (dgr.backends.placement): the flags, their refusals, and what `dgr up` passes on."""

from __future__ import annotations

import argparse

import pytest

from dgr.backends.base import LayerRange
from dgr.backends.factory import make_backend
from dgr.backends.placement import Placement, devices, parse_gpu_layers
from dgr.errors import CallerError, Reason
from dgr.up import node_args

pytestmark = [pytest.mark.llama]


def test_gpu_layers_is_all_or_a_count():
    assert [parse_gpu_layers(v) for v in ("all", "0", "7")] == [-1, 0, 7]
    for bad in ("-1", "some", "1.5", ""):
        with pytest.raises(ValueError, match="--gpu-layers takes 'all' or a count"):
            parse_gpu_layers(bad)


def _args(**kw) -> argparse.Namespace:
    base = dict(gpu_layers="0", device=None, cpu_moe=False, backend="llama_shard", ctx=256, max_sessions=2,
                stub_delay=0.0, stub_model="default", model=None)
    return argparse.Namespace(**{**base, **kw})


def test_dgr_up_gives_each_node_its_own_gpu_layers():
    args = _args(gpu_layers="all,0", device="Vulkan0", cpu_moe=True)
    gpu, cpu = Placement.per_node(args, 2)
    assert gpu == Placement(-1, "Vulkan0", True) and cpu == Placement()  # device flags go with what offloads
    first = node_args(args, LayerRange(0, 15), "http://t", "node0", 1, placement=gpu)
    second = node_args(args, LayerRange(15, 30), "http://t", "node1", 1, placement=cpu)
    assert first[first.index("--gpu-layers") + 1] == "all" and "--cpu-moe" in first and "--device" in first
    assert "--gpu-layers" not in second and "--cpu-moe" not in second and "--device" not in second
    assert [p.gpu_layers for p in Placement.per_node(_args(gpu_layers="5"), 3)] == [5, 5, 5]  # one value: all
    for bad, why in ((args, "gives 2 values for 3 nodes"),
                     (_args(device="CUDA0"), "--gpu-layers puts nothing there"),
                     (_args(gpu_layers="0,0", cpu_moe=True), "--gpu-layers puts nothing there"),
                     (_args(gpu_layers="all,x"), "takes 'all' or a count")):
        with pytest.raises(CallerError, match=why) as e:
            Placement.per_node(bad, 3 if bad is args else 2)
        assert e.value.reason is Reason.INVALID_REQUEST


def test_a_cpu_only_build_refuses_a_gpu_with_the_command_that_fixes_it(model_path):
    if devices():
        pytest.skip("this build sees a GPU")
    with pytest.raises(CallerError, match=r"sees none: install a GPU build with `make install GPU=cuda`") as e:
        make_backend("llama_shard", LayerRange(0, 15), model_path, placement=Placement(gpu_layers=-1))
    assert e.value.reason is Reason.INVALID_REQUEST
    with pytest.raises(CallerError, match="--gpu-layers is for the llama.cpp backends, not stub"):
        make_backend("stub", None, None, placement=Placement(gpu_layers=2))


_BEFORE_FORK = """
import sys
from dgr.backends import clib
from dgr.backends.base import LayerRange
from dgr.backends.llama_shard import check_shard_ranges
from dgr.forks import preload
from dgr.up import route_splits
preload("llama_shard")
from pathlib import Path
check_shard_ranges(sys.argv[1], route_splits(Path(sys.argv[1]), 30, 2))
print("backend initialised:", "lib" in clib._LIB)
"""


def test_what_dgr_up_does_before_it_forks_initialises_no_backend(model_path):
    """A CUDA backend's registration counts its devices, which initialises the CUDA driver, and a child forked
    after that cannot use it (cudaErrorInitializationError): `dgr up` preloads and checks the model with
    libllama loaded but no backend initialised (clib.llama_module); each forked node initialises its own."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BEFORE_FORK, str(model_path)], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "backend initialised: False", out.stderr[-2000:]
