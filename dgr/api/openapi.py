"""The tracker's and the nodes' OpenAPI 3 documents, each served at /openapi.json.

They describe the HTTP surface (the tracker's OpenAI endpoints, Route Session
telemetry, node registry views and membership; a node's session, tokenize,
status and artifact routes) closely enough for schemathesis to generate
valid and invalid requests against them. Every documented error is OpenAI's
error shape. The seam step (binary frames) is left to the hypothesis
properties in tests/test_fuzz.py.

Authentication: when the tracker has API keys, the OpenAI and telemetry
operations need `Authorization: Bearer KEY` (the `bearer` scheme; 401
otherwise). The empty alternative in `security` says a loopback tracker
without keys accepts them unauthenticated. `/healthz` and this document are
always open.
"""

from __future__ import annotations

from typing import Any

from dgr.seam.types import MAX_DEVICE_DESCRIPTION, MAX_DEVICE_NAME, MAX_DEVICES
from dgr.seam.wire import CAPABILITY_HEADER, ROUTE_SESSION_HEADER, NODE_HEADER, TICKET_HEADER

__all__ = ["openapi_document", "node_openapi_document"]

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"],
                             "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                            "code": {"type": "string"}, "param": {"type": "string", "nullable": True}}}},
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]},
                   "content": {"type": "string", "maxLength": 2000}},
}
_COMMON = {
    "model": {"type": "string", "minLength": 1, "maxLength": 64},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 16},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},  # OpenAPI 3.0 form
    "seed": {"type": "integer", "minimum": 0, "maximum": 2 ** 31},
    "stop": {"oneOf": [{"type": "string", "minLength": 1, "maxLength": 8},
                       {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1, "maxLength": 8}}]},
    "stream": {"type": "boolean"},
    "n": {"type": "integer", "enum": [1]},
}


def _errors(*codes: int) -> dict[str, Any]:
    return {str(c): {"description": "OpenAI-style error",
                     "content": {"application/json": {"schema": _ERROR}}} for c in codes}


def _json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def openapi_document(models: list[str] | None = None) -> dict[str, Any]:
    """The document; with `models` (the tracker's live ones) `model` is an enum of them.

    Naming the live models lets a generator's valid requests reach a route
    (and its invalid ones still try others).
    """
    common = dict(_COMMON)
    if models:
        common["model"] = {"type": "string", "enum": sorted(models)}
    ok_json = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}},
                                                "text/event-stream": {"schema": {"type": "string"}}}}
    gen_errors = _errors(400, 401, 404, 413, 429, 502, 503, 504)
    open_ = {"security": []}
    return {
        "openapi": "3.0.3",
        "info": {"title": "dgr tracker", "version": "1"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "an API key from --api-key-file or DGR_API_KEYS"}}},
        "security": [{"bearer": []}, {}],
        "paths": {
            "/healthz": {"get": {**open_, "responses": {"200": {"description": "alive",
                                                                "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/openapi.json": {"get": {**open_, "responses": {"200": {"description": "this document",
                                                                     "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/models": {"get": {"responses": {"200": {"description": "models",
                                                         "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/chat/completions": {"post": {
                "requestBody": _json_body({"type": "object", "required": ["model", "messages"], "properties": {
                    **common, "messages": {"type": "array", "minItems": 1, "maxItems": 4, "items": _MESSAGE}}}),
                "responses": {"200": ok_json, **gen_errors}}},
            "/v1/completions": {"post": {
                "requestBody": _json_body({"type": "object", "required": ["model", "prompt"], "properties": {
                    **common, "prompt": {"type": "string", "minLength": 1, "maxLength": 2000}}}),
                "responses": {"200": ok_json, **gen_errors}}},
            "/v1/route-sessions": {"get": {"responses": {"200": {"description": "sessions",
                                                                 "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/route-sessions/{sid}": {"get": {
                "parameters": [{"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "telemetry",
                                      "content": {"application/json": {"schema": {"type": "object"}}}},
                              **_errors(404)}}},
            "/v1/nodes": {"get": {"responses": {"200": {"description": "registry",
                                                        "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/stats": {"get": {"responses": {"200": {"description": "stats",
                                                        "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            # signed with the node's own key instead of an API key (401 unauthenticated or replayed otherwise;
            # 409 identity_taken for a node id that belongs to another key; a heartbeat under one is 404,
            # as for an unknown id)
            "/v1/nodes/register": {"post": {**open_, "requestBody": _json_body(_REGISTRATION),
                                            "responses": {"200": _OK, **_errors(400, 401, 409, 413)}}},
            # the node id in X-Dgr-Node too: ownership is checked before the body is parsed
            "/v1/nodes/heartbeat": {"post": {**open_, "requestBody": _json_body(_HEARTBEAT), "parameters": [
                                                 {"name": NODE_HEADER, "in": "header", "required": True,
                                                  "schema": {"type": "string"}}],
                                             "responses": {"200": _OK, **_errors(400, 401, 404, 413)}}},
            # advice for a joining node: which layers to serve (dgr.tracker.assign); signed as a registration is
            # where the tracker has an admission rule (401 otherwise)
            "/v1/assign": {"post": {**open_, "requestBody": _json_body(_ASSIGN),
                                    "responses": {"200": _OK, **_errors(400, 401, 404, 413)}}},
        },
    }


_OK = {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}
_SID = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
_REGISTRATION = {"type": "object", "required": ["node", "url", "layers", "backend", "model", "capacity"], "properties": {
    "node": {"type": "string"}, "url": {"type": "string"}, "pid": {"type": "integer"},
    "layers": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
    "backend": {"type": "string"}, "capacity": {"type": "integer"}, "max_positions": {"type": "integer"},
    "describe": {"type": "object"}, "model": {"type": "object"}, "tls_cert": {"type": "string"},
    "artifact": {"type": "object", "properties": {"manifest_id": {"type": "string"}, "seed": {"type": "string"}}}}}
_ASSIGN = {"type": "object", "required": ["manifest_id", "memory_bytes"], "properties": {
    "manifest_id": {"type": "string"}, "memory_bytes": {"type": "integer"}, "context": {"type": "integer"},
    "sessions": {"type": "integer"}}}
# a node's accelerators (none on the CPU: the field is left out); malformed ones are dropped, the beat kept
_DEVICE = {"type": "object", "required": ["name", "description", "memory_free", "memory_total"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": MAX_DEVICE_NAME},
    "description": {"type": "string", "maxLength": MAX_DEVICE_DESCRIPTION},
    "memory_free": {"type": "integer", "minimum": 0}, "memory_total": {"type": "integer", "minimum": 0}}}
_HEARTBEAT = {"type": "object", "required": ["node"], "properties": {
    "node": {"type": "string"}, "sessions": {"type": "integer"}, "kv_bytes": {"type": "integer"},
    "session_ids": {"type": "array", "items": _SID},
    "devices": {"type": "array", "maxItems": MAX_DEVICES, "items": _DEVICE}}}


def node_openapi_document() -> dict[str, Any]:
    """A node's control routes. A node with a tracker needs `X-Dgr-Capability`, signed by it, on every session
    call, with the session named in the path or `X-Dgr-Route-Session`, and an open its `X-Dgr-Ticket` (403)."""
    sid = [{"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}]
    cap = [{"name": CAPABILITY_HEADER, "in": "header", "required": False, "schema": {"type": "string"}}]
    named = [{"name": ROUTE_SESSION_HEADER, "in": "header", "required": False, "schema": _SID}]
    ticket = [{"name": TICKET_HEADER, "in": "header", "required": False, "schema": {"type": "string"}}]
    return {
        "openapi": "3.0.3",
        "info": {"title": "dgr node", "version": "1"},
        "paths": {
            # with ?session= (and the gateway's capability) the session's progress: the tracker's probe of a late step
            "/healthz": {"get": {"parameters": [{"name": "session", "in": "query", "required": False,
                                                 "schema": _SID}] + cap,
                                 "responses": {"200": _OK, **_errors(403)}}},
            "/openapi.json": {"get": {"responses": {"200": _OK}}},
            "/v1/node/status": {"get": {"responses": {"200": _OK}}},
            "/v1/seam/sessions": {"post": {
                "parameters": cap + named + ticket,
                "requestBody": _json_body({"type": "object", "required": ["session", "max_positions"], "properties": {
                    "session": _SID, "max_positions": {"type": "integer"},
                    "sampling": {"type": "object", "properties": {
                        "temperature": {"type": "number"}, "top_p": {"type": "number"}, "seed": {"type": "integer"}}},
                    # block keys of the prompt (dgr.node.prefix): open on the longest kept prefix of them
                    "prefix": {"type": "array", "maxItems": 64,
                               "items": {"type": "string", "pattern": "^[0-9a-f]{32}$"}},
                    # a head's: the prompt it tokenizes inside its open (dgr.seam.opening), the answer's positions
                    # and the prompt's limit (never a prefix root: only the tracker has it); a later hop's max_new alone:
                    # opened before the prompt's length is known, its KV waiting
                    "prompt": {"type": "object", "properties": {
                        "prompt": {"type": "string", "maxLength": 2000},
                        "messages": {"type": "array", "maxItems": 4, "items": _MESSAGE}}},
                    "max_new": {"type": "integer"}, "max_prompt": {"type": "integer"},
                    # a repair's survivor: the live session it goes on with, what it keeps of it, and where its
                    # journal is sent on from (dgr.seam.opening ResumeOrder); a repaired route's tail: sample_from
                    "resume": {"type": "object", "properties": {
                        "session": _SID, "steps": {"type": "integer"}, "positions": {"type": "integer"},
                        "replay_from": {"type": "integer"}}},
                    "sample_from": {"type": "integer"}}}),
                # 404, 410: a resume of a session this node does not hold, or that has ended
                "responses": {"201": _OK, **_errors(400, 403, 404, 409, 410, 413, 429)}}},
            "/v1/seam/sessions/{sid}/prefix": {"post": {
                "parameters": sid + cap,
                # the prefix of a session opened waiting (max_new): block keys and base64 marks
                "requestBody": _json_body({"type": "object", "properties": {
                    "prefix": {"type": "array", "maxItems": 64,
                               "items": {"type": "string", "pattern": "^[0-9a-f]{32}$"}},
                    "marks": {"type": "string", "maxLength": 2000}}}),
                "responses": {"200": _OK, **_errors(400, 403, 404, 410)}}},
            "/v1/seam/sessions/{sid}": {
                "get": {"parameters": sid + cap, "responses": {"200": _OK, **_errors(403, 404, 410)}},
                "delete": {"parameters": sid + cap + [
                    {"name": "reason", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "message", "in": "query", "required": False, "schema": {"type": "string"}},
                    # a normal close: the block keys of the session's KV, joined by '.', to keep it as a prefix
                    {"name": "keep", "in": "query", "required": False, "schema": {"type": "string"}}],
                    "responses": {"200": _OK, **_errors(400, 403, 404, 410)}}},
            "/v1/artifact": {"get": {"responses": {"200": _OK, **_errors(404)}}},
            "/v1/artifact/challenge": {"post": {"requestBody": _json_body({"type": "object"}),
                                                "responses": {"200": _OK, **_errors(400, 404, 413, 422)}}},
        },
    }
