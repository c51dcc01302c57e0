"""The tracker's OpenAPI 3 document, served at /openapi.json.

It describes the public HTTP surface (OpenAI endpoints, Route Session
telemetry, node registry views) closely enough for schemathesis to generate
valid and invalid requests against it. Every documented error is OpenAI's
error shape.

Authentication: when the tracker has API keys, the OpenAI and telemetry
operations need `Authorization: Bearer KEY` (the `bearer` scheme; 401
otherwise). The empty alternative in `security` says a loopback tracker
without keys accepts them unauthenticated. `/healthz` and this document are
always open.
"""

from __future__ import annotations

from typing import Any

__all__ = ["openapi_document"]

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
        },
    }
