"""The head's prompt at open: what it is given, and the positions its tokens leave the session.

The gateway opens a route's head with the request's prompt (issue 41): chat messages to render with
the model's template, a completion's text, or the token ids a client sent. The head tokenizes it
inside its open and keeps the ids, and names its own reusable prefix from them
(dgr.seam.keys.prompt_offer); the gateway reads the ids from the open's answer for the rest (the
other hops' prefix, the answer's bound, what is kept at close). So no round trip before compute is
spent on tokenizing alone.

Rules:
- exactly one of `messages`, `prompt` (text) or `ids` (each in this model's vocabulary);
- the tokens are not empty, at most `max_prompt` where the gateway sets a limit, and leave at least
  one of the route's positions (`max_positions`) for the answer;
- the session holds the prompt's positions plus `max_new`, within `max_positions`.

Pure: no I/O. Tokenizing is the node service's (dgr.node.service), on the backend's vocabulary.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs

from dgr.api.openai import are_token_ids, parse_messages
from dgr.errors import CallerError, Reason
from dgr.seam.keys import KEY_HEX, valid_chain

__all__ = ["PromptPlan", "count_field"]


def count_field(value: Any, name: str) -> int:
    """An open body's field `name`, a positive integer.

    Raises: CallerError(INVALID_REQUEST).
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CallerError(Reason.INVALID_REQUEST, f"{name} must be a positive integer")
    return value


@attrs.frozen
class PromptPlan:
    """A head's open of a prompt: the prompt, the prefix root it names its KV under, and its bounds."""

    messages: tuple[dict[str, Any], ...] | None
    text: str | None
    ids: tuple[int, ...] | None
    root: str | None  # the prefix root (dgr.seam.keys.prefix_root); None: reuse no prefix
    max_new: int  # positions the answer may take
    max_prompt: int | None  # the gateway's limit on the prompt's tokens; None: the context's

    @classmethod
    def from_json(cls, data: Any, *, root: Any, max_new: Any, max_prompt: Any, vocab_size: int) -> "PromptPlan":
        """An open body's "prompt" ({"messages"}, {"prompt"} or {"ids"}) and its "root", "max_new", "max_prompt".

        Raises: CallerError(INVALID_REQUEST), naming the field.
        """
        if not isinstance(data, dict) or len(data) != 1 or not set(data) <= {"messages", "prompt", "ids"}:
            raise CallerError(Reason.INVALID_REQUEST, "prompt is an object of one of messages, prompt or ids")
        text, ids = data.get("prompt"), data.get("ids")
        if "prompt" in data and not isinstance(text, str):
            raise CallerError(Reason.INVALID_REQUEST, "prompt.prompt must be a string")
        if "ids" in data and not are_token_ids(ids, vocab_size):
            raise CallerError(Reason.INVALID_REQUEST,
                              f"prompt.ids must be token ids of this vocabulary of {vocab_size}")
        if root is not None and not valid_chain([root], 1):  # a root is a key's shape
            raise CallerError(Reason.INVALID_REQUEST, f"root must be {KEY_HEX} lowercase hex digits")
        messages = parse_messages(data["messages"]) if "messages" in data else None
        return cls(messages, text, None if ids is None else tuple(ids), root, count_field(max_new, "max_new"),
                   None if max_prompt is None else count_field(max_prompt, "max_prompt"))

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
