from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("DGR_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="long soak/fuzz run: set DGR_SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
