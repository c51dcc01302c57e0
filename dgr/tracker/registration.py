"""A node's registration and heartbeat bodies, read and checked: network JSON in, typed values out.

One job: everything a node says about itself arrives from the network, so
every field is type- and range-checked here, and anything wrong is a
`CallerError(INVALID_REQUEST)` (400), never a crash (500). dgr.tracker.registry
decides what a checked registration or heartbeat may change (ownership of
node ids, TLS, proofs, layers within the model).

Rules: integers are ints in [lo, 2^63) (bools, floats and strings refused);
strings are non-empty and at most 1024 characters; a URL is
http(s)://HOST:PORT; a heartbeat lists at most `MAX_HELD` session ids and
names at most `MAX_PREFIXES` kept prefixes' block keys; a boot nonce
(dgr.security.auth `new_boot`) is 32 lowercase hex digits, and optional (a
registration without one gets credentials bound to none). A heartbeat's
`devices` (its accelerators' memory) that break the wire's bounds
(dgr.seam.types: at most `MAX_DEVICES`, unique printable names, free <=
total) are dropped with the reason, not refused: they are readings for
people, and a heartbeat refused for them would cost the node its liveness
and its routes. A wildcard host
(0.0.0.0, ::) in a URL or seed address is replaced by the source address the
tracker saw the registration come from (`reachable`). A declared capacity is
bounded here by the tracker's `max_capacity`; what it is trusted with is
NodeEntry's.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

import attrs

from dgr.api.hosts import is_wildcard
from dgr.errors import CallerError, Reason
from dgr.seam.keys import MAX_ADVERTISED
from dgr.seam.types import MAX_DEVICE_DESCRIPTION, MAX_DEVICE_NAME, MAX_DEVICES, DeviceMemory, ModelInfo
from dgr.seam.wire import KEY_HEX

__all__ = ["MAX_HELD", "MAX_PREFIXES", "Heartbeat", "Registration", "reachable", "read_heartbeat",
           "read_registration"]

MAX_HELD = 65536  # session ids one heartbeat may list
MAX_PREFIXES = MAX_ADVERTISED  # kept prefixes' keys one heartbeat may name
_KEY = re.compile(f"[0-9a-f]{{{KEY_HEX}}}")
_SID = re.compile(r"[0-9a-f]{32}")
_BOOT = _SID  # a boot nonce is 128 random bits in hex, as a session id


@attrs.frozen
class Registration:
    """What a registration says, checked: the fields of a NodeEntry that come from the node."""

    node_id: str
    url: str
    start: int
    stop: int
    backend: str
    model: ModelInfo
    capacity: int
    describe: dict[str, Any]
    pid: int | None
    max_positions: int
    prefixes: frozenset[str]
    tls_cert: str | None = None
    manifest_id: str | None = None
    seed: str | None = None
    boot: str = ""  # the node process's boot nonce: its capabilities and tickets are bound to it
    wants_spare: bool = False  # it asks to be kept idle as a spare (dgr.tracker.spares)


@attrs.frozen
class Heartbeat:
    """What a heartbeat says, checked."""

    sessions: int
    kv_bytes: int
    held: frozenset[str]
    prefixes: frozenset[str]
    devices: tuple[DeviceMemory, ...] = ()
    devices_dropped: str | None = None  # why the heartbeat's devices were dropped, when they were
    draining: bool = False  # the node is stopping (SIGTERM): hand its sessions over (dgr.tracker.drain)
    boot: str | None = None  # the node process's boot nonce; None: not said


def read_registration(data: dict[str, Any], *, seen: str | None, max_capacity: int) -> Registration:
    """The registration `data`, reached from host `seen`, its capacity bounded by `max_capacity`.

    Raises:
        CallerError(INVALID_REQUEST): a malformed registration.
    """
    try:
        model = _model(data.get("model"))
        layers = data.get("layers")
        if not isinstance(layers, list) or len(layers) != 2:
            raise ValueError("layers must be [start, stop]")
        start, stop = _int({"start": layers[0]}, "start"), _int({"stop": layers[1]}, "stop")
        fields: dict[str, Any] = dict(
            node_id=_str(data, "node"),
            url=reachable(_url(data.get("url")), seen),
            start=start,
            stop=stop,
            backend=_str(data, "backend"),
            model=model,
            capacity=min(_int(data, "capacity"), max_capacity),
            describe=_describe(data.get("describe")),
            pid=_int(data, "pid") if data.get("pid") is not None else None,
            max_positions=_int(data, "max_positions", 1, default=model.context_length),
            prefixes=_prefixes(data),
            boot=_boot(data) or "",
            wants_spare=_flag(data, "spare"),
        )
        cert = data.get("tls_cert")
        if cert is not None:
            if not isinstance(cert, str) or "BEGIN CERTIFICATE" not in cert or len(cert) > 16384:
                raise ValueError("tls_cert must be a PEM certificate")
            fields["tls_cert"] = cert
        artifact = data.get("artifact")
        if artifact is not None:
            fields["manifest_id"] = _str(artifact, "manifest_id")
            fields["seed"] = reachable(str(artifact["seed"]), seen) if artifact.get("seed") else None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"bad registration: {exc}"[:300]) from None
    return Registration(**fields)


def read_heartbeat(data: dict[str, Any]) -> Heartbeat:
    """The heartbeat `data`'s figures.

    Raises:
        CallerError(INVALID_REQUEST): a malformed heartbeat.
    """
    try:
        sessions = _int(data, "sessions", default=0)
        kv_bytes = _int(data, "kv_bytes", default=0)
        held = data.get("session_ids", [])
        if not isinstance(held, list) or len(held) > MAX_HELD or not all(
                isinstance(s, str) and _SID.fullmatch(s) for s in held):
            raise ValueError(f"session_ids must be a list of at most {MAX_HELD} session ids")
        prefixes = _prefixes(data)
        boot = _boot(data)
        draining = _flag(data, "draining")
    except ValueError as exc:
        raise CallerError(Reason.INVALID_REQUEST, f"bad heartbeat: {exc}"[:300]) from None
    try:
        devices, dropped = _devices(data.get("devices", [])), None
    except ValueError as exc:
        devices, dropped = (), str(exc)[:300]
    return Heartbeat(sessions=sessions, kv_bytes=kv_bytes, held=frozenset(held), prefixes=prefixes,
                     devices=devices, devices_dropped=dropped, boot=boot, draining=draining)


def _flag(data: dict[str, Any], name: str) -> bool:
    """An optional boolean (absent: False). Raises ValueError."""
    value = data.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false")
    return value


def _boot(data: dict[str, Any]) -> str | None:
    """The message's boot nonce, None when it names none. Raises ValueError."""
    boot = data.get("boot")
    if boot is not None and not (isinstance(boot, str) and _BOOT.fullmatch(boot)):
        raise ValueError("boot must be 32 lowercase hex digits")
    return boot


def _devices(value: Any) -> tuple[DeviceMemory, ...]:
    """A heartbeat's accelerators with their memory (none when absent). Raises ValueError."""
    if not isinstance(value, list) or len(value) > MAX_DEVICES:
        raise ValueError(f"devices must be a list of at most {MAX_DEVICES} objects")
    out = []
    for d in value:
        if not isinstance(d, dict):
            raise ValueError("each device must be an object")
        free, total = _int(d, "memory_free"), _int(d, "memory_total")
        if free > total:
            raise ValueError(f"a device's memory_free ({free}) exceeds its memory_total ({total})")
        out.append(DeviceMemory(name=_label(d, "name", MAX_DEVICE_NAME),
                                description=_label(d, "description", MAX_DEVICE_DESCRIPTION, empty=True),
                                memory_free=free, memory_total=total))
    if len({d.name for d in out}) != len(out):  # each is a metric series of its own
        raise ValueError("device names must be unique")
    return tuple(out)


def _label(data: dict[str, Any], key: str, limit: int, *, empty: bool = False) -> str:
    """A string shown to people and in metric labels: printable (no newline, no control character), at most
    `limit` characters, non-empty unless `empty`."""
    value = data.get(key)
    if not isinstance(value, str) or len(value) > limit or not value.isprintable() or not (value or empty):
        raise ValueError(f"a device's {key} must be a printable string of at most {limit} characters")
    return value


def _prefixes(data: dict[str, Any]) -> frozenset[str]:
    """The kept prefixes' keys a registration or heartbeat names (none when absent). Raises ValueError."""
    keys = data.get("prefixes", [])
    if not isinstance(keys, list) or len(keys) > MAX_PREFIXES or not all(
            isinstance(k, str) and _KEY.fullmatch(k) for k in keys):
        raise ValueError(f"prefixes must be a list of at most {MAX_PREFIXES} {KEY_HEX}-digit hex block keys")
    return frozenset(keys)


def _int(data: dict[str, Any], key: str, lo: int = 0, default: int | None = None) -> int:
    """An integer field in [lo, 2^63); bools, floats and strings are refused."""
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value < 2 ** 63:
        raise ValueError(f"{key} must be an integer >= {lo}, got {value!r}"[:200])
    return value


def _str(data: dict[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise ValueError(f"{key} must be a non-empty string")
    return value


def _model(data: Any) -> ModelInfo:
    if not isinstance(data, dict):
        raise ValueError("model must be an object")
    metadata = data.get("metadata", {})
    needs = data.get("needs_token_ids", False)
    drops = data.get("drops_positions", False)  # a node that does not say cannot speculate
    if not isinstance(metadata, dict) or not isinstance(needs, bool) or not isinstance(drops, bool):
        raise ValueError("model.metadata must be an object, model.needs_token_ids and drops_positions booleans")
    return ModelInfo(
        name=_str(data, "name"), architecture=_str(data, "architecture"), n_layers=_int(data, "n_layers", 1),
        hidden_size=_int(data, "hidden_size", 1), seam_width=_int(data, "seam_width", 1),
        vocab_size=_int(data, "vocab_size", 1), context_length=_int(data, "context_length", 1),
        digest=_str(data, "digest"), needs_token_ids=needs, drops_positions=drops, metadata=metadata,
    )


def _describe(value: Any) -> dict[str, Any]:
    """A node's self-description (its backend's `describe()`): an object, shown nested, never trusted."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError("describe must be an object")
    return value


def _url(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("url must be a string")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"url must look like http://HOST:PORT, got {value[:100]!r}")
    return value


def reachable(address: str, seen: str | None) -> str:
    """`address` (a URL or HOST:PORT) with a wildcard host replaced by `seen`, the host the tracker saw.

    A node bound to 0.0.0.0 or :: cannot be reached there; the source address of
    its registration is where its packets came from, so the best guess at where
    the tracker (and other nodes) reach it.
    """
    if not seen:
        return address
    scheme, sep, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":")
    if not is_wildcard(host):
        return address
    shown = f"[{seen}]" if ":" in seen else seen
    return f"{scheme}{sep}{shown}:{port}"
