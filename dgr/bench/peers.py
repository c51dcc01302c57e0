"""llama.cpp's own `llama-server` and `rpc-server` as bench baselines.

They are built from the llama.cpp copy vendored in the llama-cpp-python sdist
of the version installed here, with the same CPU flags as the Makefile's
build, so both sides run the same kernels. The sdist comes from the package
registry (`pip download`), never from a model or source hub; the binaries are
cached under the user's cache folder and built once.

Rules:
- every server listens on 127.0.0.1 on a port the OS picked;
- a server is stopped with SIGTERM, then SIGKILL, when its `with` ends;
- llama-server is ready at its `listening on` line (printed once its model is loaded).

Left out: GPU builds and multimodal options (a speculative type goes in `LlamaServer.extra`).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import attrs

from dgr.errors import PeerError
from dgr.procs import WatchedChild
from dgr.testing.harness import free_port

__all__ = ["LLAMA_CMAKE_ARGS", "PeerTools", "ensure_tools", "LlamaServer", "RpcServer", "tools_dir"]

# The Makefile's LLAMA_CMAKE_ARGS (a test keeps the two equal): GGML_NATIVE=ON
# compiles AMX kernels that crash on these CPUs.
LLAMA_CMAKE_ARGS: tuple[str, ...] = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                                     "-DGGML_F16C=ON", "-DGGML_BMI2=ON")
# Only what the two tools need, linked statically so the cached binaries stand alone: no tests,
# examples, TLS or libcurl.
_TOOL_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")
_TARGETS = ("llama-server", "ggml-rpc-server")  # build targets, and the binaries' names in build/bin


@attrs.frozen
class PeerTools:
    server: Path
    rpc: Path
    version: str  # llama-cpp-python's, whose vendored llama.cpp they were built from


def tools_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "dgr" / f"llama.cpp-{importlib.metadata.version('llama-cpp-python')}"


def ensure_tools(log=lambda msg: None) -> PeerTools:
    """The two binaries, built on first use (several minutes on 2 cores).

    Raises:
        RuntimeError: the sdist could not be fetched or the build failed; the
            message names the step and holds the tail of its output.
    """
    version = importlib.metadata.version("llama-cpp-python")
    out = tools_dir()
    tools = PeerTools(out / "bin" / "llama-server", out / "bin" / "rpc-server", version)
    if tools.server.is_file() and tools.rpc.is_file():
        return tools
    with tempfile.TemporaryDirectory(prefix="dgr-llama.cpp-") as tmp:
        sdist = _cached_sdist(version)
        if sdist is None:
            log(f"fetching the llama-cpp-python {version} sdist")
            _step([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                   f"llama-cpp-python=={version}", "-d", tmp], "pip download")
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"{sdist.name[: -len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, members=[m for m in tar.getmembers() if m.name.startswith(prefix)], filter="data")
        src, build = Path(tmp) / prefix, Path(tmp) / "build"
        log(f"building {', '.join(_TARGETS)} from its vendored llama.cpp")
        generator = ("-G", "Ninja") if shutil.which("ninja") else ()
        _step(["cmake", "-S", str(src), "-B", str(build), *generator, *LLAMA_CMAKE_ARGS, *_TOOL_ARGS], "cmake")
        _step(["cmake", "--build", str(build), "--target", *_TARGETS, "-j", str(os.cpu_count() or 1)], "build")
        (out / "bin").mkdir(parents=True, exist_ok=True)
        for name, dest in zip(_TARGETS, (tools.server, tools.rpc)):
            shutil.copy2(build / "bin" / name, dest)
    return tools


def _cached_sdist(version: str) -> Path | None:
    """The sdist llama/build.sh keeps (it built dgr's own wheel from it), so a build needs no download."""
    base = Path(os.environ.get("DGR_WHEEL_CACHE") or Path.home() / ".cache" / "dgr" / "wheels")
    sdist = base / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    return sdist if sdist.is_file() else None


def _step(cmd: Sequence[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{what} failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")


def _listening(line: str) -> dict[str, Any] | None:
    """llama-server's ready line: it listens only once its model is loaded."""
    return {} if "listening on http" in line else None


@attrs.define
class RpcServer:
    """One `rpc-server`: a ggml CPU device that a llama-server reaches over TCP."""

    tools: PeerTools
    threads: int
    port: int = 0
    child: WatchedChild | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "RpcServer":
        self.port = free_port()
        # it prints no ready line we can rely on: ready is accepting a connection
        self.child = WatchedChild.spawn("rpc-server", [str(self.tools.rpc), "-H", "127.0.0.1", "-p", str(self.port),
                                                       "-t", str(self.threads)], is_ready=lambda line: None)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.child.popen.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"rpc-server did not listen within 60 s:\n{self.child.output_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self.child is not None:
            self.child.stop(grace_s=10)


@attrs.define
class LlamaServer:
    """One `llama-server` serving the OpenAI API; with `rpc`, its layers live on those rpc-servers."""

    tools: PeerTools
    model: str
    threads: int
    ctx: int
    parallel: int = 1
    rpc: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()  # more llama-server options (a speculative decoding type)
    port: int = 0
    child: WatchedChild | None = None

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        # -c is the total context; llama-server divides it among its -np slots.
        cmd = [str(self.tools.server), "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.ctx * self.parallel),
               "-np", str(self.parallel), "-b", "512", "--no-webui"]
        if self.rpc:
            cmd += ["--rpc", ",".join(self.rpc), "-ngl", "999"]
        return cmd + list(self.extra)

    def __enter__(self) -> "LlamaServer":
        self.port = free_port()
        self.child = WatchedChild.spawn("llama-server", self.command(), is_ready=_listening)
        try:
            self.child.wait_ready(300)
        except PeerError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.child is not None:
            self.child.stop(grace_s=10)
