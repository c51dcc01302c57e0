"""OpenAI request parsing and response shapes, with no I/O.

`parse_request` turns a chat or completions body into a `GenerationRequest`
or raises `CallerError(INVALID_REQUEST, param=...)` naming the bad field, the
way OpenAI does. The builders produce the exact JSON shapes the official
clients read. dgr adds, and standard clients ignore:
- a top-level `dgr` object on non-streaming responses (route session id and
  final telemetry);
- in streams, SSE comment lines `: dgr-telemetry {...}` (always), and, only
  when the request sets `dgr_telemetry: true`, extra chunks with
  `choices: []` and a `dgr_telemetry` object.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import attrs

from dgr.errors import CallerError, Reason
from dgr.sampling import SamplingParams
from dgr.seam.opening import are_token_ids, parse_messages  # an open carries the prompt: the seam checks it

__all__ = ["GenerationRequest", "parse_request", "parse_messages", "completion_body", "chunk_body", "usage_body",
           "are_token_ids", "DEFAULT_MAX_TOKENS", "SPECULATION", "SPEC_GRANTS", "SPEC_ALLOW_DEFAULT"]

DEFAULT_MAX_TOKENS = 256
MAX_STOP = 4


# What drafts a speculative step (issue 42): n-gram lookup or the route tail's draft model (`--draft-model`), each
# also with every node computing a step's positions one at a time ("-exact": answers equal to decoding without
# speculation), or none.
SPECULATION = ("ngram", "ngram-exact", "draft", "draft-exact", "off")
# What an operator may let a request ask for (`dgr tracker --spec-allow`, issue 55): a mode, or "prompt", which
# lets an n-gram tail be sent the prompt's last ids to draft from (a draft model always reads them). "off" and the
# tracker's own `--spec` need no grant. By default only n-gram drafts from the answer itself: "-exact" costs
# every node of the route a llama_decode per drafted position, and a draft model the tail's CPU.
SPEC_GRANTS = ("ngram", "ngram-exact", "draft", "draft-exact", "prompt")
SPEC_ALLOW_DEFAULT = ("ngram",)


@attrs.frozen
class GenerationRequest:
    kind: Literal["chat", "completion"]
    model: str
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    telemetry_chunks: bool
    ignore_eos: bool = False  # vLLM's extension: benchmarks need a fixed number of tokens
    prompt_ids: tuple[int, ...] | None = None  # a completions prompt given as token ids
    # dgr's extension (issue 42): "ngram" drafts tokens from the session's own, "draft" from the route tail's
    # draft model ("-exact": with answers equal to decoding without speculation), "off" none; None: the tracker's
    speculation: str | None = None

    def prompt_bytes(self) -> int:
        """UTF-8 bytes of the text to tokenize: the messages' contents, or the prompt string."""
        if self.kind == "chat":
            return sum(len(str(m.get("content", "")).encode("utf-8", "surrogatepass")) for m in self.messages or ())
        return len((self.prompt or "").encode("utf-8", "surrogatepass"))

    def prompt_body(self) -> dict[str, Any]:
        """The prompt as the route's head tokenizes it inside its open (dgr.seam.opening)."""
        if self.kind == "chat":
            return {"messages": list(self.messages or ())}
        return {"prompt": self.prompt}


def _bad(message: str, param: str) -> CallerError:
    return CallerError(Reason.INVALID_REQUEST, message, param=param)


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"'{key}' must be a number", key)
    if not (lo <= value <= hi):
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {value}", key)
    return float(value)




def parse_request(body: dict[str, Any], kind: Literal["chat", "completion"]) -> GenerationRequest:
    """Validate an OpenAI body.

    Raises:
        CallerError(INVALID_REQUEST) with `param` naming the field.
    """
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    messages = prompt = None
    prompt_ids: tuple[int, ...] | None = None
    if kind == "chat":
        messages = parse_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if prompt and are_token_ids(prompt, 2 ** 31):
            prompt_ids = tuple(prompt)
            prompt = None
        elif not isinstance(prompt, str) or not prompt:
            raise _bad("'prompt' must be a non-empty string or an array of token ids", "prompt")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key, DEFAULT_MAX_TOKENS)
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise _bad(f"'{key}' must be a positive integer, got {max_tokens!r}", key)
    n = body.get("n", 1)
    if n not in (1, None):
        raise _bad("only n=1 is supported", "n")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    seed = body.get("seed")  # checked by SamplingParams, the one sampling validator
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = tuple(stop)
    else:
        raise _bad(f"'stop' must be a string or an array of at most {MAX_STOP} strings", "stop")
    if any(s == "" for s in stops):
        raise _bad("'stop' strings must not be empty", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    telemetry = body.get("dgr_telemetry", False)
    if not isinstance(telemetry, bool):
        raise _bad("'dgr_telemetry' must be a boolean", "dgr_telemetry")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    speculation = body.get("speculation")
    if speculation not in (None, *SPECULATION):
        raise _bad(f"'speculation' must be one of {', '.join(SPECULATION)}", "speculation")
    return GenerationRequest(
        kind=kind,
        model=model,
        messages=messages,
        prompt=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, seed=seed),
        stop=stops,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        telemetry_chunks=telemetry,
        ignore_eos=ignore_eos,
        prompt_ids=prompt_ids,
        speculation=speculation,
    )


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, repairs: int = 0
               ) -> dict[str, Any]:
    """OpenAI's usage block; `cached_tokens` are prompt tokens whose KV a kept prefix supplied; `repairs`, dgr's
    own and only where there were some, the times the answer's route lost a node and was repaired (--resume)."""
    body = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if repairs:
        body["repairs"] = repairs
    return body


def _ids(req: GenerationRequest, sid: str) -> tuple[str, str]:
    if req.kind == "chat":
        return f"chatcmpl-{sid}", "chat.completion"
    return f"cmpl-{sid}", "text_completion"


def completion_body(req: GenerationRequest, sid: str, text: str, finish_reason: str,
                    usage: dict[str, int], telemetry: dict[str, Any], created: int | None = None) -> dict[str, Any]:
    rid, obj = _ids(req, sid)
    if req.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return {
        "id": rid,
        "object": obj,
        "created": created or int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": usage,
        "system_fingerprint": None,
        "dgr": {"route_session": sid, "telemetry": telemetry},
    }


def chunk_body(req: GenerationRequest, sid: str, created: int, *, text: str | None = None,
               role: bool = False, finish_reason: str | None = None, usage: dict[str, int] | None = None,
               telemetry: dict[str, Any] | None = None) -> dict[str, Any]:
    rid, obj = _ids(req, sid)
    if req.kind == "chat":
        obj = "chat.completion.chunk"
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model,
                            "system_fingerprint": None}
    if usage is not None or telemetry is not None:
        body["choices"] = []
        if usage is not None:
            body["usage"] = usage
        if telemetry is not None:
            body["dgr_telemetry"] = telemetry
        return body
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
    body["choices"] = [choice]
    return body
