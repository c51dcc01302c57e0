"""Sizes and nodes as people type them: `24GiB`, `--nodes 4 --memory 128GiB --gpu-memory 24GiB`, `--node a=24GiB`,
`--node a=128GiB,gpu=24GiB`.

Binary units without a `B` (24G) and with `iB` (24GiB); decimal with `B` (24GB).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

from dgr.errors import CallerError, Reason

__all__ = [
    "Node",
    "format_size",
    "parse_nodes",
    "parse_size",
]


_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from '24GiB', '24G' (binary), '24GB' (decimal), '512MiB' or a plain number.

    Raises:
        CallerError(INVALID_REQUEST)
    """
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise CallerError(Reason.INVALID_REQUEST, f"not a size: {text!r} (try 24GiB, 64GB or 512MiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Bytes for people: GiB with two decimals from 1 GiB up, else MiB or KiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


@attrs.frozen
class Node:
    """A machine that can serve one shard: a name, the host memory dgr may use on it, and its GPU's (0: none)."""

    name: str
    memory_bytes: int
    gpu_bytes: int = 0


def _node_spec(spec: str, gpu: int) -> Node:
    """`name=SIZE` or `name=SIZE,gpu=SIZE` (its own GPU memory instead of --gpu-memory's)."""
    name, sep, rest = spec.partition("=")
    size, _, extra = rest.partition(",")
    key, sep2, gpu_size = extra.partition("=")
    if not sep or not name or (extra and (key != "gpu" or not sep2)):
        raise CallerError(Reason.INVALID_REQUEST, f"--node wants name=SIZE or name=SIZE,gpu=SIZE, got {spec!r}")
    return Node(name, parse_size(size), parse_size(gpu_size) if extra else gpu)


def parse_nodes(
    count: int | None, memory: str | None, specs: Sequence[str], gpu_memory: str | None = None
) -> list[Node]:
    """Nodes from `--nodes N --memory SIZE` or from `--node name=SIZE[,gpu=SIZE]` (repeated); `--gpu-memory SIZE`
    gives each node a GPU of that size (a `--node`'s own gpu= wins).

    Raises:
        CallerError(INVALID_REQUEST)
    """
    gpu = parse_size(gpu_memory) if gpu_memory is not None else 0
    if specs and (count is not None or memory is not None):
        raise CallerError(Reason.INVALID_REQUEST, "give either --node name=SIZE ... or --nodes N --memory SIZE")
    if specs:
        nodes = [_node_spec(spec, gpu) for spec in specs]
        if len({n.name for n in nodes}) != len(nodes):
            raise CallerError(Reason.INVALID_REQUEST, "node names must be distinct")
        return nodes
    if count is None or memory is None:
        raise CallerError(Reason.INVALID_REQUEST, "give --nodes N --memory SIZE, or --node name=SIZE for each node")
    if count < 1:
        raise CallerError(Reason.INVALID_REQUEST, f"--nodes must be at least 1, got {count}")
    size = parse_size(memory)
    return [Node(f"node{i + 1}", size, gpu) for i in range(count)]
