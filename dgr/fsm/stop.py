"""The one stop rule: after a route samples a token, does a next decode step go out, and if not, why.

Two places decide it, and they must decide alike: the gateway, and the
ring's tail, which sends the next step to the head itself
without waiting for the gateway (dgr.node.replies `next_step_frame`). Both call
`next_step`; only stop strings are the gateway's alone (the tail never sees
text), and they end a session from the gateway, whose close discards any
step the tail sent on.

The count: `generated` tokens against `max_tokens`. The gateway counts
completion tokens; the tail counts positions (the next step's position plus
one, against the positions the session was opened on, which are the
prompt's plus `max_tokens`). Both counts are offset by the prompt's length,
so they agree.

Left out: a client that went away or a failure (those cancel the session,
they are not a stop).
"""

from __future__ import annotations

import attrs

__all__ = ["Next", "next_step"]


@attrs.frozen
class Next:
    more: bool  # a next decode step goes out
    finish: str | None = None  # why not, as OpenAI's finish_reason: "stop" or "length"


_MORE = Next(True)
_STOP = Next(False, "stop")
_LENGTH = Next(False, "length")


def next_step(*, eog: bool, ignore_eos: bool, generated: int, max_tokens: int, stopped: bool = False) -> Next:
    """After a sampled token (`eog`: it ends generation), with `generated` counted as above.

    `stopped`: a stop string matched (the gateway's text only).
    """
    if (eog and not ignore_eos) or stopped:
        return _STOP
    if generated >= max_tokens:
        return _LENGTH
    return _MORE
