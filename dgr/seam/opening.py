"""The open of a node session, and the naming of its prefix, as they cross the wire: one type each way.

`POST /v1/seam/sessions` carries an `OpenRequest` and is answered an `OpenAnswer`;
`POST /v1/seam/sessions/<sid>/prefix` (adopt: name the prefix to a session whose KV waits) carries an
`AdoptRequest` and is answered an `OpenAnswer` without tokens. The gateway builds them
(dgr.tracker.opening, which hop gets which is dgr.fsm.opening's table); the node reads them with
`from_json`, the only place their fields are checked.

Rules:
- `from_json` checks every field against the receiving node's own bounds (`max_positions`, the
  positions one session may hold there, and `vocab_size`) and raises CallerError with a reason code
  and `param` naming the field; nothing is checked twice on the node. What only the node can judge
  (whether it is a head, a tail, has a tracker, a draft model, memory that drops positions, trusts a
  url) stays with the node (dgr.node.app).
- An open carries at most one of `prompt` (a head given the prompt: it tokenizes it) and `max_new`
  alone (a later hop opened before the prompt's length is known, its KV waiting). A head's prompt
  brings its own `max_new` (required) and `max_prompt` (`PromptPlan`); never a prefix root, which
  only the tracker holds (dgr.seam.keys): its prefix is named to it once the ids are known.
- A repair's open of a survivor carries `resume` (`ResumeOrder`: the live session it goes on with, issue 54)
  and none of a prompt, a prefix, `max_new` or speculation: its KV is its old session's. A resumed
  session's answer adds the steps it holds and its journal's first step.
- One encoder, `_to_json`, is every message's `to_json` but the open's: it writes the fields as their
  metadata declares. The open writes itself: it flattens the prefix and the prompt it carries.
- The answer is read leniently where a lie costs nothing (`prefix_positions` not a count reads as 0:
  the route then reuses nothing) and strictly where it would cost the client (a head's token ids:
  PeerError naming the node, never the client's fault).

Left out: the headers (session, capability, ticket) and the transport (dgr.tracker.seam_client).
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import attrs

from dgr.errors import CallerError, PeerError, Reason
from dgr.sampling import SamplingParams
from dgr.seam.keys import MAX_MARKS, decode_marks, encode_marks, valid_chain
from dgr.seam.wire import BLOCK_TOKENS, KEY_HEX, MAX_DRAFTS, ROUTE_SESSION_HEADER
from dgr.speculative.adapt import K_MAX
from dgr.speculative.ngram import WINDOW

__all__ = ["are_token_ids", "parse_messages", "DRAFT_SOURCES", "NextHop", "Loop", "RelayOrder", "SpecPlan", "PromptPlan", "OpenRequest", "ResumeOrder",
           "AdoptRequest", "OpenAnswer", "token_bound"]

DRAFT_SOURCES = ("ngram", "draft")  # the session's own tokens; the tail's draft model
MAX_LANE = 1 << 16  # a phase lane (dgr.fsm.phases) is a small sequence slot number
_MAX_ROUTE = 8192  # a ring's route key: its node ids, comma-separated
_SID = re.compile(r"[0-9a-f]{32}")
# Tokens a chat template may add beyond one per byte of the request's JSON (which already counts each
# message's keys and quotes): a default system prompt, the assistant's opening.
_TEMPLATE_TOKENS = 1024


def _to_json(message: Any) -> dict[str, Any]:
    """`message`'s JSON object: its attrs fields in order, each under its name or its metadata's `wire` name,
    left out at its `omit` value or while the field it goes `beside` is None; the value through its `encode`,
    else a message (any attrs class: SamplingParams too) as its own object, a tuple as a list."""
    out: dict[str, Any] = {}
    for f in attrs.fields(type(message)):
        value, how = getattr(message, f.name), f.metadata
        if ("omit" in how and value == how["omit"]) or ("beside" in how and getattr(message, how["beside"]) is None):
            continue
        if "encode" in how:
            value = how["encode"](value)
        elif attrs.has(type(value)):
            value = _to_json(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[how.get("wire", f.name)] = value
    return out


def _bad(message: str, param: str, reason: Reason = Reason.INVALID_REQUEST) -> CallerError:
    return CallerError(reason, message, param=param)


def are_token_ids(value: Any, limit: int) -> bool:
    """`value` is a list of token ids in [0, limit) (bools are not ids)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit
                                           for t in value)


def parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """Chat messages as {"role", "content"} objects with string contents.

    Raises:
        CallerError(INVALID_REQUEST) with `param` naming the bad message or field.
    """
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise _bad(f"messages[{i}].role must be system, user, assistant, developer or tool", f"messages[{i}].role")
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _count(value: Any, name: str) -> int:
    """A positive integer field. Raises: CallerError(INVALID_REQUEST)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _bad(f"{name} must be a positive integer", name)
    return value


@attrs.frozen
class NextHop:
    """The node after this one on a ring, and this session's capability there."""

    node: str
    url: str
    capability: str | None
    tls_cert: str | None = None  # its registered certificate, pinned when `url` is https

    to_json = _to_json

    @classmethod
    def from_json(cls, data: Any, what: str) -> NextHop:
        """{node, url, capability, tls_cert}. Raises: CallerError(INVALID_REQUEST), `param` `what`."""
        if (not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("node", "url"))
                or not data["url"].startswith(("http://", "https://"))
                or any(data.get(k) is not None and not isinstance(data[k], str) for k in ("capability", "tls_cert"))):
            raise _bad(f"{what} needs a node id and an http(s):// url", what)
        return cls(data["node"], data["url"], data.get("capability"), data.get("tls_cert"))


@attrs.frozen
class Loop:
    """On a ring, the tail's second link: each next decode step goes straight to the head.

    The tail decides what the gateway would: it sends the step for the token it sampled unless that
    token ends generation (end of generation without `ignore_eos`, or the session's last position).
    Stops only the gateway sees (stop strings, a client gone) end the session from there instead.
    """

    head: NextHop
    ignore_eos: bool = False


@attrs.frozen
class RelayOrder:
    """An open's `relay`: where the node sends its results (the next hop; none on the tail), its capability
    for the tracker (DELIVER on the tail, REPORT elsewhere), the route (its node ids, comma-separated) and its
    length, and on a ring's tail the `loop`. The node adds its own tracker (dgr.node.relay.RelayPlan)."""

    next: NextHop | None
    deliver_capability: str | None = None
    route: str = ""
    nodes: int = 1
    loop: Loop | None = attrs.field(default=None, metadata={"omit": None})  # a ring's tail's only

    to_json = _to_json

    @classmethod
    def from_json(cls, data: Any) -> RelayOrder:
        """Raises: CallerError(INVALID_REQUEST), naming the field."""
        if not isinstance(data, dict):
            raise _bad("relay must be an object: every session is on a ring", "relay")
        nxt, cap = data.get("next"), data.get("deliver_capability")
        if cap is not None and not isinstance(cap, str):
            raise _bad("relay.deliver_capability must be a string", "relay.deliver_capability")
        hop = None if nxt is None else NextHop.from_json(nxt, "relay.next")
        route, nodes = data.get("route", ""), data.get("nodes", 1)
        if (not isinstance(route, str) or len(route) > _MAX_ROUTE
                or not isinstance(nodes, int) or isinstance(nodes, bool) or not 1 <= nodes <= MAX_LANE):
            raise _bad("relay.route is the route's node ids, relay.nodes their count", "relay.route")
        loop = data.get("loop")
        if loop is not None:
            if not isinstance(loop, dict) or not isinstance(loop.get("ignore_eos", False), bool):
                raise _bad("relay.loop is a ring tail's {head, ignore_eos}", "relay.loop")
            loop = Loop(NextHop.from_json(loop.get("head"), "relay.loop.head"), loop.get("ignore_eos", False))
        return cls(hop, cap, route, nodes, loop)


@attrs.frozen
class SpecPlan:
    """What a session's open asks of speculation (issue 42, dgr.node.speculation): the drafts a step may
    carry, whether k is fixed, whether steps compute their rows one at a time (`exact`), where drafts come
    from, and, for the tail, the prompt's tokens to draft from."""

    k_max: int = K_MAX
    exact: bool = False
    source: str = "ngram"  # or "draft": the tail's draft model
    fixed_k: int | None = attrs.field(default=None, metadata={"omit": None})
    history: tuple[int, ...] = attrs.field(default=(), metadata={"omit": ()})

    to_json = _to_json

    @classmethod
    def from_json(cls, data: Any, vocab_size: int) -> SpecPlan:
        """{k_max, exact, fixed_k?, history?, source?}. Raises: CallerError(INVALID_REQUEST), naming the field."""
        if not isinstance(data, dict) or set(data) - {"k_max", "exact", "fixed_k", "history", "source"}:
            raise _bad("spec must be an object of k_max, exact, fixed_k, history and source", "spec")
        k_max, exact, fixed = data.get("k_max"), data.get("exact", False), data.get("fixed_k")
        history, source = data.get("history", []), data.get("source", "ngram")
        if source not in DRAFT_SOURCES:
            raise _bad(f"spec.source must be one of {', '.join(DRAFT_SOURCES)}", "spec.source")
        if not isinstance(k_max, int) or isinstance(k_max, bool) or not 1 <= k_max <= MAX_DRAFTS:
            raise _bad(f"spec.k_max must be an integer in [1, {MAX_DRAFTS}]", "spec.k_max")
        if fixed is not None and (not isinstance(fixed, int) or isinstance(fixed, bool) or not 0 <= fixed <= k_max):
            raise _bad("spec.fixed_k must be an integer in [0, k_max]", "spec.fixed_k")
        if not isinstance(exact, bool) or not are_token_ids(history, vocab_size) or len(history) > WINDOW:
            raise _bad(f"spec.exact must be a boolean and spec.history at most {WINDOW} token ids of this "
                       "vocabulary", "spec.history")
        return cls(k_max=k_max, fixed_k=fixed, exact=exact, history=tuple(history), source=source)


@attrs.frozen
class PromptPlan:
    """A head's open of a prompt (issue 41): chat messages, a completion's text or token ids (exactly one),
    and its bounds. The head tokenizes it inside its open."""

    messages: tuple[dict[str, Any], ...] | None
    text: str | None
    ids: tuple[int, ...] | None
    max_new: int  # positions the answer may take
    max_prompt: int | None  # the gateway's limit on the prompt's tokens; None: the context's

    @classmethod
    def of(cls, body: dict[str, Any], *, max_new: int, max_prompt: int | None) -> PromptPlan:
        """The plan of the prompt `body` ({"messages"}, {"prompt"} or {"ids"}, as the API's request has it)."""
        ids = body.get("ids")
        return cls(None if "messages" not in body else tuple(body["messages"]), body.get("prompt"),
                   None if ids is None else tuple(ids), max_new, max_prompt)

    def body(self) -> dict[str, Any]:
        """The wire's `prompt` object."""
        if self.messages is not None:
            return {"messages": list(self.messages)}
        return {"prompt": self.text} if self.text is not None else {"ids": list(self.ids or ())}

    def param(self) -> str:
        """The API request's parameter that holds this prompt: a refusal of it is the client's."""
        return "messages" if self.messages is not None else "prompt"

    @classmethod
    def from_json(cls, data: Any, *, max_new: Any, max_prompt: Any, vocab_size: int) -> PromptPlan:
        """An open's "prompt" and its "max_new" and "max_prompt".

        Raises: CallerError(INVALID_REQUEST), naming the field.
        """
        if not isinstance(data, dict) or len(data) != 1 or not set(data) <= {"messages", "prompt", "ids"}:
            raise _bad("prompt is an object of one of messages, prompt or ids", "prompt")
        text, ids = data.get("prompt"), data.get("ids")
        if "prompt" in data and not isinstance(text, str):
            raise _bad("prompt.prompt must be a string", "prompt.prompt")
        if "ids" in data and not are_token_ids(ids, vocab_size):
            raise _bad(f"prompt.ids must be token ids of this vocabulary of {vocab_size}", "prompt.ids")
        messages = parse_messages(data["messages"]) if "messages" in data else None
        return cls(messages, text, None if ids is None else tuple(ids), _count(max_new, "max_new"),
                   None if max_prompt is None else _count(max_prompt, "max_prompt"))

    def positions(self, ids: Sequence[int], max_positions: int) -> int:
        """The session's positions for the prompt's tokens `ids`, where they fit.

        Raises:
            CallerError(INVALID_REQUEST): no tokens.
            CallerError(CONTEXT_LENGTH_EXCEEDED): more than `max_prompt`, or none left for the answer.
        """
        n = len(ids)
        if not n:
            raise CallerError(Reason.INVALID_REQUEST, "the prompt is empty after tokenizing", param="prompt")
        if self.max_prompt is not None and n > self.max_prompt:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED,
                              f"the prompt has {n} tokens; this gateway accepts at most {self.max_prompt}",
                              param="prompt")
        if n >= max_positions:
            raise CallerError(Reason.CONTEXT_LENGTH_EXCEEDED, f"the prompt has {n} tokens; this route's context is "
                                                              f"{max_positions} and at least one must remain for the "
                                                              "answer", param="prompt")
        return min(max_positions, n + self.max_new)


@attrs.frozen
class AdoptRequest:
    """The prefix a session may start from: its block keys (one per BLOCK_TOKENS positions) and the marks of
    its positions. An adopt's whole body; an open carries it too."""

    prefix: tuple[str, ...] = ()
    marks: bytes = attrs.field(default=b"", metadata={"encode": encode_marks})  # MARK_BYTES a position (token_marks)

    to_json = _to_json

    @classmethod
    def from_json(cls, data: dict[str, Any], max_positions: int) -> AdoptRequest:
        """A body's "prefix" and "marks", at most what a session of `max_positions` holds.

        Raises: CallerError(INVALID_REQUEST), naming the field.
        """
        prefix = data.get("prefix") or []
        if not valid_chain(prefix, max_positions // BLOCK_TOKENS + 1):
            raise _bad(f"prefix must be a list of {KEY_HEX}-digit hex block keys", "prefix")
        marks = decode_marks(data.get("marks", ""), min(max_positions, MAX_MARKS))
        if marks is None:
            raise _bad("marks must be base64 position marks, at most one a position", "marks")
        return cls(tuple(prefix), marks)


@attrs.frozen
class ResumeOrder:
    """A repair's open of a survivor (issue 54): go on with its live session `session` under the open's fresh id,
    keeping at most `steps` steps of it (`positions`: what those hold), and send on first its journal's steps
    from `replay_from` (dgr.node.journal), those the hop after it lacks."""

    session: str
    steps: int
    positions: int
    replay_from: int

    to_json = _to_json

    @classmethod
    def from_json(cls, data: Any, max_positions: int) -> ResumeOrder:
        """Raises: CallerError(INVALID_REQUEST), naming the field."""
        if (not isinstance(data, dict) or set(data) != {"session", "steps", "positions", "replay_from"}
                or not isinstance(data["session"], str) or not _SID.fullmatch(data["session"])
                or not all(_natural(data[k]) for k in ("steps", "positions", "replay_from"))
                or data["positions"] > max_positions or data["replay_from"] > data["steps"]):
            raise _bad("resume is {session, steps, positions, replay_from}: a session id, and counts with "
                       "replay_from <= steps and positions within this node's", "resume")
        return cls(data["session"], data["steps"], data["positions"], data["replay_from"])


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@attrs.frozen
class OpenRequest:
    """The open of one node session (`POST /v1/seam/sessions`)."""

    session: str  # 32 lowercase hex digits; the header `X-Dgr-Route-Session` names it too
    max_positions: int  # the session's positions (a head's: the route's context, its prompt's plus max_new)
    relay: RelayOrder  # every session is on a ring
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    reuse: AdoptRequest = AdoptRequest()  # the prefix to open on now; none: a head's KV waits for an adopt
    lane: int | None = None  # the session's phase lane (dgr.fsm.phases)
    spec: SpecPlan | None = None  # None: the session does not speculate
    prompt: PromptPlan | None = None  # a head's: the prompt to tokenize
    max_new: int | None = None  # a later hop's, without a prompt: it opens before the prompt's length is known
    resume: ResumeOrder | None = None  # a repair's survivor: the session it goes on with (issue 54)
    # a repaired route's tail: it answers no step that ends at or before this position (they were answered)
    sample_from: int = 0

    def to_json(self) -> dict[str, Any]:
        p = self.prompt
        fields = {
            "session": self.session, "max_positions": self.max_positions, "sampling": _to_json(self.sampling),
            "relay": self.relay.to_json(),
            "prefix": list(self.reuse.prefix) or None, "marks": encode_marks(self.reuse.marks) or None,
            "lane": self.lane, "spec": None if self.spec is None else self.spec.to_json(),
            "prompt": None if p is None else p.body(),
            "max_new": self.max_new if p is None else p.max_new, "max_prompt": None if p is None else p.max_prompt,
            "resume": None if self.resume is None else self.resume.to_json(), "sample_from": self.sample_from or None,
        }
        return {k: v for k, v in fields.items() if v is not None}  # what this open does not carry is left out

    def encode(self) -> bytes:
        """The exact bytes sent (the tracker's ticket signs them)."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: Any, *, named: str | None, max_positions: int, vocab_size: int) -> OpenRequest:
        """An open's body, the session it opens being the one `named` in its header where there is one (a node
        without a tracker also takes an open that names it in the body only), its prefix at most what a
        session of this node's `max_positions` holds, its ids in [0, `vocab_size`).

        Raises: CallerError(BAD_FRAME | INVALID_REQUEST), naming the field.
        """
        if not isinstance(data, dict):
            raise _bad("the body must be a JSON object", "body")
        sid = data.get("session")
        if named is not None and sid != named:
            raise _bad(f"the body opens another session than {ROUTE_SESSION_HEADER} names", "session")
        if not isinstance(sid, str) or not _SID.fullmatch(sid):
            raise _bad("session must be 32 lowercase hex digits", "session", Reason.BAD_FRAME)
        positions = data.get("max_positions")
        if not isinstance(positions, int) or isinstance(positions, bool):
            raise _bad("max_positions must be an integer", "max_positions")
        sampling = data.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise _bad("sampling must be an object", "sampling")
        try:  # SamplingParams checks each value, the one validator the gateway uses too
            params = SamplingParams(**sampling)
        except TypeError as exc:  # a field it does not have, or a value no range check can compare
            raise CallerError(Reason.INVALID_REQUEST, f"bad sampling parameters: {exc}") from None
        reuse = AdoptRequest.from_json(data, max_positions)
        lane = data.get("lane")
        if lane is not None and (not isinstance(lane, int) or isinstance(lane, bool) or not 0 <= lane < MAX_LANE):
            raise _bad(f"lane must be an integer in [0, {MAX_LANE})", "lane")
        relay = RelayOrder.from_json(data.get("relay"))
        spec = None if data.get("spec") is None else SpecPlan.from_json(data["spec"], vocab_size)
        prompt = None if "prompt" not in data else PromptPlan.from_json(
            data["prompt"], max_new=data.get("max_new"), max_prompt=data.get("max_prompt"),
            vocab_size=vocab_size)
        # a later hop opened with the head: the prompt's length is not known, only what the answer may add
        max_new = None if prompt is not None or data.get("max_new") is None else _count(data["max_new"], "max_new")
        resume = None if data.get("resume") is None else ResumeOrder.from_json(data["resume"], max_positions)
        sample_from = data.get("sample_from", 0)
        if not _natural(sample_from):
            raise _bad("sample_from must be a position", "sample_from")
        if resume is not None and (prompt is not None or max_new is not None or reuse.prefix or spec is not None):
            raise _bad("a resumed session carries its KV: no prompt, prefix, max_new or speculation", "resume")
        return cls(sid, positions, relay, params, reuse, lane, spec, prompt, max_new, resume, sample_from)


@attrs.frozen
class OpenAnswer:
    """A node's answer to an open or an adopt: the positions it holds of the prefix named; a head given the
    prompt also its ids."""

    session: str
    node: str
    positions: int = attrs.field(metadata={"wire": "prefix_positions"})
    tokens: list[int] | None = attrs.field(default=None, metadata={"omit": None})  # a head's given the prompt
    # a resumed session's (issue 54): the steps it holds, and its journal's first step (None: it keeps none)
    steps: int | None = attrs.field(default=None, metadata={"omit": None})
    journal_from: int | None = attrs.field(default=None, metadata={"beside": "steps"})

    to_json = _to_json

    @classmethod
    def from_json(cls, data: dict[str, Any], *, node: str, tokens_bound: int | None = None,
                  vocab_size: int | None = None) -> OpenAnswer:
        """`node`'s answer; with `tokens_bound` (it was given a prompt), its ids: a list of at most that many
        integers in [0, vocab_size).

        Raises: PeerError(NODE_ERROR), naming the node, for ids that cannot be.
        """
        reused = data.get("prefix_positions", 0)  # not a count: the route then reuses nothing
        positions = reused if isinstance(reused, int) and not isinstance(reused, bool) and reused >= 0 else 0
        sid = data.get("session") if isinstance(data.get("session"), str) else ""
        steps, first = data.get("steps"), data.get("journal_from")
        if steps is not None:  # a resumed session's: its counts decide what the repair sends, so they must be counts
            if not _natural(steps) or not (first is None or _natural(first)):
                raise PeerError(Reason.NODE_ERROR, f"{node} answered a resume with steps {str(steps)[:40]!r} and "
                                                   f"journal_from {str(first)[:40]!r}", node=node)
            return cls(sid, node, positions, None, steps, first)
        if tokens_bound is None:
            return cls(sid, node, positions)
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or len(tokens) > tokens_bound:
            got = f"{len(tokens)} tokens" if isinstance(tokens, list) else type(tokens).__name__
            raise PeerError(Reason.NODE_ERROR, f"{node} tokenized the prompt into {got}; at most {tokens_bound} "
                                               "token ids can come of it", node=node)
        top = vocab_size if vocab_size is not None else 2 ** 31
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < top:
                raise PeerError(Reason.NODE_ERROR, f"{node} sent token id {str(t)[:40]!r}, not one of its "
                                                   f"vocabulary of {top}", node=node)
        return cls(sid, node, positions, tokens)


def token_bound(prompt: PromptPlan) -> int:
    """The most tokens an honest head makes of `prompt`: one per byte of its JSON, and a template's own."""
    return len(json.dumps(prompt.body()).encode()) + _TEMPLATE_TOKENS
