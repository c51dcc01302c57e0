"""Typed errors, one reason enum, and the single reason -> HTTP table.

Rules:
- Every error dgr raises on purpose is a `DgrError` carrying a `Reason`.
- `CallerError`: whoever called us sent something wrong (bad frame, bad JSON,
  out-of-order step). Answered with a 4xx; our state is unchanged.
- `PeerError`: a peer we depend on failed us (a node vanished, timed out or
  answered 5xx). Answered with a 5xx; the Route Session fails.
- `HTTP_TABLE` is the only place that maps a reason to a status code and an
  OpenAI error `type`. A test checks it covers every reason.

This module imports only the standard library and attrs, so the pure FSM core
can use it.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import attrs

__all__ = [
    "Reason",
    "Failure",
    "DgrError",
    "CallerError",
    "PeerError",
    "IllegalTransition",
    "HTTP_TABLE",
    "http_status",
    "openai_error_body",
    "parse_error_body",
    "first_dgr_error",
]


class Reason(enum.Enum):
    """Why something was refused or failed. Values are the wire codes."""

    # A client of the OpenAI API sent something wrong.
    INVALID_JSON = "invalid_json"
    INVALID_REQUEST = "invalid_request_error"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    BODY_TOO_LARGE = "body_too_large"
    PROMPT_TOO_LARGE = "prompt_too_large"  # more prompt text than the token limit can hold: refused before tokenizing
    NOT_FOUND = "not_found"
    # A seam peer sent a frame that does not fit the session.
    UNKNOWN_SESSION = "unknown_session"
    SESSION_ENDED = "session_ended"
    SESSION_EXISTS = "session_exists"
    STEP_OUT_OF_ORDER = "step_out_of_order"
    POSITION_DISCONTINUITY = "position_discontinuity"
    BAD_FRAME = "bad_frame"
    WRONG_WIDTH = "wrong_width"
    WRONG_DTYPE = "wrong_dtype"
    WRONG_SIZE = "wrong_size"
    BAD_CHECKSUM = "bad_checksum"
    FRAME_TOO_LARGE = "frame_too_large"
    ILLEGAL_TRANSITION = "illegal_transition"
    # Who may talk to whom.
    UNAUTHENTICATED = "unauthenticated"
    REPLAYED = "replayed"
    FORBIDDEN = "forbidden"
    IDENTITY_TAKEN = "identity_taken"  # a node id registered by another key: ids are never taken over
    # Capacity.
    NODE_AT_CAPACITY = "node_at_capacity"
    # The route failed us.
    NO_ROUTE = "no_route"
    ROUTE_NODE_LOST = "route_node_lost"
    NODE_DRAINING = "node_draining"  # a node stopping (SIGTERM) hands its session over: a repair's cause, not a loss
    NODE_ERROR = "node_error"
    SESSION_TIMEOUT = "session_timeout"
    CANCELLED = "cancelled"
    SLOW_CLIENT = "slow_client"  # a streaming reader stopped reading: its session is cancelled, KV freed
    MODEL_LOAD_FAILED = "model_load_failed"
    # Model Artifacts: a file or a possession proof does not match its manifest.
    ARTIFACT_MISMATCH = "artifact_mismatch"
    PROOF_FAILED = "proof_failed"
    # A Prefix Snapshot on disk is not of this node's model, layers or bytes (dgr.node.snapshot).
    SNAPSHOT_MISMATCH = "snapshot_mismatch"
    INTERNAL = "internal_error"


@attrs.frozen
class Failure:
    """The structured reason a session failed. Sticky once recorded."""

    reason: Reason
    message: str
    node: str | None = None
    phase: str | None = None
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.reason.value,
            "message": self.message,
            "node": self.node,
            "phase": self.phase,
            "step": self.step,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Failure":
        return cls(
            reason=Reason(data["code"]),
            message=str(data.get("message", "")),
            node=data.get("node"),
            phase=data.get("phase"),
            step=data.get("step"),
        )


class DgrError(Exception):
    """Base of every deliberate dgr error. Carries a reason and details."""

    def __init__(self, reason: Reason, message: str, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.details = details

    def failure(self, **override: Any) -> Failure:
        fields = {k: self.details.get(k) for k in ("node", "phase", "step")}
        fields.update(override)
        return Failure(reason=self.reason, message=self.message, **fields)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.reason.value}: {self.message})"


class CallerError(DgrError):
    """Our caller sent something wrong. 4xx; our state did not change."""


class PeerError(DgrError):
    """A peer we depend on failed. 5xx; the session it served fails."""


class IllegalTransition(CallerError):
    """An event that the state machine's table has no entry for."""

    def __init__(self, machine: str, state: str, event: str) -> None:
        super().__init__(
            Reason.ILLEGAL_TRANSITION,
            f"{machine}: event {event!r} is not allowed in state {state!r}",
            machine=machine,
            state=state,
            event=event,
        )


# reason -> (HTTP status, OpenAI error "type")
HTTP_TABLE: dict[Reason, tuple[int, str]] = {
    Reason.INVALID_JSON: (400, "invalid_request_error"),
    Reason.INVALID_REQUEST: (400, "invalid_request_error"),
    Reason.MODEL_NOT_FOUND: (404, "invalid_request_error"),
    Reason.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error"),
    Reason.BODY_TOO_LARGE: (413, "invalid_request_error"),
    Reason.PROMPT_TOO_LARGE: (413, "invalid_request_error"),
    Reason.NOT_FOUND: (404, "invalid_request_error"),
    Reason.UNKNOWN_SESSION: (404, "seam_error"),
    Reason.SESSION_ENDED: (410, "seam_error"),
    Reason.SESSION_EXISTS: (409, "seam_error"),
    Reason.STEP_OUT_OF_ORDER: (409, "seam_error"),
    Reason.POSITION_DISCONTINUITY: (409, "seam_error"),
    Reason.BAD_FRAME: (400, "seam_error"),
    Reason.WRONG_WIDTH: (422, "seam_error"),
    Reason.WRONG_DTYPE: (422, "seam_error"),
    Reason.WRONG_SIZE: (422, "seam_error"),
    Reason.BAD_CHECKSUM: (422, "seam_error"),
    Reason.FRAME_TOO_LARGE: (413, "seam_error"),
    Reason.ILLEGAL_TRANSITION: (409, "seam_error"),
    Reason.UNAUTHENTICATED: (401, "authentication_error"),
    Reason.REPLAYED: (401, "authentication_error"),
    Reason.FORBIDDEN: (403, "permission_error"),
    Reason.IDENTITY_TAKEN: (409, "permission_error"),
    Reason.NODE_AT_CAPACITY: (429, "rate_limit_error"),
    Reason.NO_ROUTE: (503, "route_error"),
    Reason.ROUTE_NODE_LOST: (502, "route_error"),
    Reason.NODE_DRAINING: (503, "route_error"),
    Reason.NODE_ERROR: (502, "route_error"),
    Reason.SESSION_TIMEOUT: (504, "route_error"),
    Reason.CANCELLED: (499, "route_error"),
    Reason.SLOW_CLIENT: (408, "route_error"),
    Reason.MODEL_LOAD_FAILED: (500, "server_error"),
    Reason.ARTIFACT_MISMATCH: (422, "artifact_error"),
    Reason.PROOF_FAILED: (403, "artifact_error"),
    Reason.SNAPSHOT_MISMATCH: (422, "artifact_error"),
    Reason.INTERNAL: (500, "server_error"),
}


def http_status(reason: Reason) -> int:
    return HTTP_TABLE[reason][0]


def openai_error_body(failure: Failure, **extra: Any) -> dict[str, Any]:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}} plus dgr fields."""
    _, kind = HTTP_TABLE[failure.reason]
    body: dict[str, Any] = {
        "message": failure.message,
        "type": kind,
        "param": extra.pop("param", None),
        "code": failure.reason.value,
        "node": failure.node,
        "phase": failure.phase,
        "step": failure.step,
    }
    body.update(extra)
    return {"error": body}


def parse_error_body(body: bytes | str) -> tuple[str | None, str]:
    """(code, message) of an `openai_error_body` another process sent; (None, the body's start) for any other body.

    The one reader of peers' error bodies: a peer's code is a string here, not a
    Reason, because a newer peer may send one this process does not know.
    """
    try:
        err = json.loads(body)["error"]
        code, message = err.get("code"), err.get("message", "")
        return (None if code is None else str(code)), str(message if message is not None else "")
    except (ValueError, KeyError, TypeError, AttributeError):
        text = body if isinstance(body, str) else body[:200].decode(errors="replace")
        return None, text[:200]


def first_dgr_error(exc: BaseException) -> BaseException:
    """The first DgrError inside an exception group (trio nurseries wrap child errors), else `exc`.

    A group holding only cancellations is returned as is so that trio's cancel
    scopes can still catch it.
    """
    if isinstance(exc, DgrError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_dgr_error(inner)
            if isinstance(found, DgrError):
                return found
    return exc
