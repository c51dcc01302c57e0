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

Also here: `llama_lib()`, the one place that initialises libllama and routes
its log into a small ring buffer (printed only with DGR_LLAMA_LOG=1), so
load errors can quote llama.cpp's own reason.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.sandbox

from dgr.errors import CallerError, Reason
from dgr.models import check_gguf_file

__all__ = ["CHATML_TEMPLATE", "GgufText", "llama_lib", "llama_log_tail"]

# llama.cpp's own fallback when a GGUF carries no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_LOG: collections.deque[str] = collections.deque(maxlen=40)
_LIB: dict[str, Any] = {}


def llama_lib() -> Any:
    """The `llama_cpp.llama_cpp` ctypes module, with the backend initialised once."""
    if "lib" in _LIB:
        return _LIB["lib"]
    import llama_cpp.llama_cpp as lib  # deferred: importing it loads libllama

    echo = os.environ.get("DGR_LLAMA_LOG") == "1"

    @lib.llama_log_callback
    def _log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", "replace")
        _LOG.append(line)
        if echo:
            sys.stderr.write(line)

    lib.llama_log_set(_log, ctypes.c_void_p(0))
    lib.llama_backend_init()
    _LIB["log_cb"] = _log  # a freed callback would crash the next log call
    _LIB["lib"] = lib
    return lib


def llama_log_tail(n: int = 6) -> str:
    """The last lines llama.cpp logged, joined, for error messages."""
    return "".join(list(_LOG)[-n:]).strip()


def _raise_exception(message: str) -> None:
    raise CallerError(Reason.INVALID_REQUEST, f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@attrs.define
class GgufText:
    """Tokenizer, chat template and detokenizer of one GGUF file."""

    path: Path
    chat_template: str
    bos_token: str
    eos_token: str
    n_vocab: int
    _model: int | None = attrs.field(repr=False)  # llama_model *
    _vocab: int | None = attrs.field(repr=False)  # const llama_vocab *
    _template: jinja2.Template = attrs.field(repr=False)
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
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            template = env.from_string(source)
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
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise CallerError(Reason.INVALID_REQUEST, f"chat template failed: {exc}") from None

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
