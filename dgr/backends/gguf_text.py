"""Text in and out for any GGUF model: tokenizer, chat template, token bytes.

Every backend (llama.cpp or torch) tokenizes and detokenizes the same way, so
this lives apart from the llama backends. It loads the GGUF's vocabulary only
(`vocab_only`, no weights) through llama-cpp-python's ctypes API, whose
tokenizer is the reference for GGUF files, and renders the GGUF's own
`tokenizer.chat_template` with jinja2 in an immutable sandbox, as Hugging Face
transformers does (trim_blocks, lstrip_blocks, loopcontrols, a non-escaping
`tojson`, `raise_exception`, `strftime_now`).

`token_bytes` returns a token's raw piece bytes, not text: one UTF-8
character may span several tokens, so the caller decodes incrementally.

Message contents are user text, never markup: `tokenize_chat` tokenizes the
template's own text with control tokens parsed and every message content
with them not parsed, so a user who writes `<|im_start|>system` gets those
characters, not a forged turn (see `ChatTemplate.segments` for how the
contents are found in the rendered prompt). A render is bounded in time
(`ChatTemplate.limit_s`), and `*` and `**` in a template are bounded in size.

libllama itself is loaded, and its log kept, by dgr.backends.clib.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.sandbox

from dgr.backends.base import Vocabulary
from dgr.backends.clib import llama_lib, llama_log_tail
from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "Segment", "GgufText"]

# llama.cpp's own fallback when a GGUF carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

def _raise_exception(message: str) -> None:
    raise CallerError(Reason.INVALID_REQUEST, f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_TEMPLATE_FILE = "<template>"  # the file name jinja2 compiles templates from source under
_MAX_REPEAT = 1 << 20  # the longest string or list a template may build with `*`


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `'x' * n` and `a ** b` bounded (jinja2's sandbox bounds only `range`)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise jinja2.sandbox.SecurityError("exponent too large")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                    raise jinja2.sandbox.SecurityError("repetition too long")
        return super().call_binop(context, operator, left, right)


@attrs.frozen
class Segment:
    """A piece of a rendered chat prompt: template markup (`special`) or a message's content."""

    text: str
    special: bool  # True: the template's text, control tokens parsed; False: user text, never parsed for them


@attrs.define
class ChatTemplate:
    """A GGUF chat template in a bounded sandbox, rendered into markup and content segments.

    Raises (constructor): jinja2.TemplateError on a template that does not compile.
    """

    source: str
    limit_s: float = 2.0  # one render's budget; past it the request is refused
    _template: jinja2.Template = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(self.source)

    def render(self, messages: list[dict[str, Any]], *, bos_token: str = "", eos_token: str = "") -> str:
        """The prompt text of `messages`, ending with the assistant cue.

        Raises:
            CallerError(INVALID_REQUEST): the template refused the messages, failed, or ran past `limit_s`.
        """
        return self._render(messages, bos_token, eos_token, time.perf_counter() + self.limit_s)

    def _render(self, messages: list[dict[str, Any]], bos: str, eos: str, deadline: float) -> str:
        """Render under a line tracer that stops a template still running at `deadline`.

        A template is Python code compiled by jinja2, and its loops run in
        frames of `_TEMPLATE_FILE`: the tracer watches only those, so a loop
        of any shape is caught between two of its steps. It is installed for
        this thread and this call only, and the caller's tracer comes back.
        """

        def on_line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line" and time.perf_counter() > deadline:
                raise CallerError(Reason.INVALID_REQUEST, f"the chat template ran past {self.limit_s:g}s")
            return on_line

        def on_call(frame: Any, event: str, arg: Any) -> Any:
            return on_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

        previous = sys.gettrace()
        sys.settrace(on_call)
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                         eos_token=eos)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                ArithmeticError, RecursionError) as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"chat template failed: {type(exc).__name__}: {exc}"[:300]) from None
        finally:
            sys.settrace(previous)

    def segments(self, messages: list[dict[str, Any]], *, bos_token: str = "",
                 eos_token: str = "") -> list[Segment]:
        """The rendered prompt as markup and content segments, in order.

        How the contents are found: a second, "shadow" render replaces each
        content with a marker that no user can send (private-use characters
        around a per-call random nonce and the message's index), so the text
        between markers is the template's own, wherever and however often it
        places each content. The real render must then equal that markup
        with each content put back, as sent or trimmed (templates often
        `| trim` it): the segments are exact. Searching the real render for
        the contents instead is not safe: a content equal to nearby markup
        (`<|im_end|>`) would match the markup and leave the real content to
        be parsed for control tokens. A template that changes contents in any
        other way, or branches on them, gets its markup from the shadow
        render and the contents as sent, so user text is still never parsed
        for control tokens; one that mangles the markers themselves (slices
        a content, say) is refused.

        Raises:
            CallerError(INVALID_REQUEST): the template failed or ran past `limit_s`.
        """
        deadline = time.perf_counter() + self.limit_s
        real = self._render(messages, bos_token, eos_token, deadline)
        nonce = str(secrets.randbelow(10 ** 18))  # digits: unchanged by `upper`, `lower`, `title`
        shadow_messages = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
        shadow = self._render(shadow_messages, bos_token, eos_token, deadline)
        parts: list[Segment | int] = []
        pos = 0
        for mark in re.finditer("\ue000" + nonce + r":(\d+)\ue001", shadow):
            parts.append(Segment(shadow[pos : mark.start()], True))
            parts.append(int(mark.group(1)))
            pos = mark.end()
        parts.append(Segment(shadow[pos:], True))
        if any(isinstance(p, Segment) and ("\ue000" in p.text or "\ue001" in p.text) for p in parts):
            raise CallerError(Reason.INVALID_REQUEST, "this model's chat template rewrites message contents so that "
                              "they cannot be told from its markup; refusing rather than reading control tokens "
                              "in them")
        contents = [str(m.get("content", "")) for m in messages]
        candidates = []
        for fit in (lambda c: c, str.strip):
            candidate = [p if isinstance(p, Segment) else Segment(fit(contents[p]), False) for p in parts]
            if "".join(c.text for c in candidate) == real:
                return _merged(candidate)
            candidates.append(candidate)
        return _merged(candidates[0])


def _merged(parts: list[Segment]) -> list[Segment]:
    """Drop empty segments and join neighbours of one kind."""
    out: list[Segment] = []
    for p in parts:
        if not p.text:
            continue
        if out and out[-1].special == p.special:
            out[-1] = Segment(out[-1].text + p.text, p.special)
        else:
            out.append(p)
    return out


@attrs.define
class GgufText(Vocabulary):
    """Tokenizer, chat template and detokenizer of one GGUF file: its `Vocabulary`, loaded without weights."""

    text_apart = True  # a vocabulary-only model: nothing here is any compute's

    path: Path
    chat_template: str
    bos_token: str
    eos_token: str
    n_vocab: int
    _model: int | None = attrs.field(repr=False)  # llama_model *
    _vocab: int | None = attrs.field(repr=False)  # const llama_vocab *
    _template: ChatTemplate = attrs.field(repr=False)
    _piece: ctypes.Array = attrs.field(repr=False, factory=lambda: ctypes.create_string_buffer(256))

    @classmethod
    def load(cls, path: str | Path) -> GgufText:
        """Load the vocabulary (no weights) of the GGUF at `path`.

        Raises:
            CallerError(MODEL_LOAD_FAILED): missing, unreadable or not a usable GGUF.
        """
        p = check_gguf_file(path)
        lib = llama_lib()
        params = lib.llama_model_default_params()
        params.vocab_only = True
        model = lib.llama_model_load_from_file(str(p).encode(), params)
        if not model:
            raise CallerError(
                Reason.MODEL_LOAD_FAILED, f"llama.cpp cannot load the vocabulary of {p}: {llama_log_tail()}"
            )
        vocab = lib.llama_model_get_vocab(model)
        raw = lib.llama_model_chat_template(model, None)
        source = raw.decode("utf-8") if raw else CHATML_TEMPLATE
        try:
            template = ChatTemplate(source)
        except jinja2.TemplateError as exc:
            lib.llama_model_free(model)
            raise CallerError(Reason.MODEL_LOAD_FAILED, f"bad chat template in {p}: {exc}") from None
        self = cls(
            path=p,
            chat_template=source,
            bos_token="",
            eos_token="",
            n_vocab=lib.llama_vocab_n_tokens(vocab),
            model=model,
            vocab=vocab,
            template=template,
        )
        self.bos_token = self._special_text(lib.llama_vocab_bos(vocab))
        self.eos_token = self._special_text(lib.llama_vocab_eos(vocab))
        return self

    def _special_text(self, tok: int) -> str:
        if tok < 0:
            return ""
        return self.token_bytes(tok, special=True).decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of `text`; add_special adds BOS/EOS as the model asks, parse_special reads control tokens."""
        lib = llama_lib()
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # only if a piece tokenized to more tokens than bytes; retry at the size it asks
            cap = -n
            buf = (lib.llama_token * cap)()
            n = lib.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise CallerError(Reason.INVALID_REQUEST, "text could not be tokenized")
        return list(buf[:n])

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of `messages` under the model's chat template, ending with the assistant cue.

        Raises:
            CallerError(INVALID_REQUEST): the template refused the messages.
        """
        return self._template.render(messages, bos_token=self.bos_token, eos_token=self.eos_token)

    def tokenize_chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], str]:
        """Token ids and prompt text of `messages`: control tokens only from the template's markup.

        Raises:
            CallerError(INVALID_REQUEST): the template refused the messages or ran too long.
        """
        segments = self._template.segments(messages, bos_token=self.bos_token, eos_token=self.eos_token)
        tokens: list[int] = []
        for i, seg in enumerate(segments or [Segment("", True)]):
            tokens += self.tokenize(seg.text, add_special=i == 0, parse_special=seg.special)
        return tokens, "".join(seg.text for seg in segments)

    def token_bytes(self, tok: int, *, special: bool = False) -> bytes:
        """Raw bytes of one token's piece. Control tokens are empty unless special."""
        lib = llama_lib()
        if not (0 <= tok < self.n_vocab):
            raise CallerError(Reason.INVALID_REQUEST, f"token id {tok} outside vocabulary of {self.n_vocab}")
        n = lib.llama_token_to_piece(self._vocab, tok, self._piece, len(self._piece), 0, special)
        if n < 0:
            self._piece = ctypes.create_string_buffer(-n)
            n = lib.llama_token_to_piece(self._vocab, tok, self._piece, len(self._piece), 0, special)
        return self._piece.raw[:n]

    def is_eog(self, tok: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, <|im_end|>, ...)."""
        return bool(llama_lib().llama_vocab_is_eog(self._vocab, tok))

    def close(self) -> None:
        """Free the vocabulary. Idempotent."""
        if self._model:
            llama_lib().llama_model_free(self._model)
            self._model = None
            self._vocab = None
