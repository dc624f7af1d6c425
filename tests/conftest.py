import os
import sys

import pytest
import torch

from ddtree import envs

sys.path.insert(0, os.path.dirname(__file__))

if not torch.cuda.is_available():
    # Triton decorates its own library functions (tl.sum, ...) when it is first imported, and transformers'
    # model code imports it: turn the CPU interpreter on before any test file can, whatever order they run in.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def toy_pair(tmp_path_factory):
    """(target_dir, drafter_dir): a tiny target and DFlash drafter trained in seconds on a regular synthetic
    corpus, so drafts are really accepted. Cached across sessions in $DDTREE_CACHE when set."""
    from ddtree.tools.train.toy import build_toy_pair

    root = envs.CACHE.get()
    out = os.path.join(root, "toy_pair") if root else str(tmp_path_factory.mktemp("toy_pair"))
    return build_toy_pair(out)


@pytest.fixture(scope="session")
def toy_hybrid_pair(tmp_path_factory):
    """(target_dir, drafter_dir) like `toy_pair`, with a hybrid Qwen3.5 target (3 Gated DeltaNet layers + 1
    gated full-attention layer). Cached across sessions in $DDTREE_CACHE when set."""
    from ddtree.tools.train.toy import build_toy_hybrid_pair

    root = envs.CACHE.get()
    out = (
        os.path.join(root, "toy_hybrid_pair")
        if root
        else str(tmp_path_factory.mktemp("toy_hybrid_pair"))
    )
    return build_toy_hybrid_pair(out)


def _dflash2_pair(pair, name, hybrid, tmp_path_factory):
    from ddtree.tools.train.toy import build_toy_dflash2_drafter

    root = envs.CACHE.get()
    out = os.path.join(root, name) if root else str(tmp_path_factory.mktemp(name))
    return pair[0], build_toy_dflash2_drafter(out, pair[0], hybrid=hybrid)


@pytest.fixture(scope="session")
def toy_dflash2_pair(toy_pair, tmp_path_factory):
    """(target_dir, drafter_dir): `toy_pair`'s target with a DFlash2 drafter trained for it by the
    same recipe plus the selector's loss (seconds). Cached across sessions in $DDTREE_CACHE."""
    return _dflash2_pair(toy_pair, "toy_dflash2_pair", False, tmp_path_factory)


@pytest.fixture(scope="session")
def toy_hybrid_dflash2_pair(toy_hybrid_pair, tmp_path_factory):
    """(target_dir, drafter_dir): `toy_hybrid_pair`'s target with a DFlash2 drafter (as above)."""
    return _dflash2_pair(toy_hybrid_pair, "toy_hybrid_dflash2_pair", True, tmp_path_factory)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops gain nothing from a second thread, and on a busy 2-core box spinning OpenMP threads crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    """Tests marked `timing` bound wall-clock time, which a loaded machine stretches: they run only
    when asked for (`python3 -m pytest -m timing`), never in the default suite."""
    if "timing" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="wall-clock bound: run with -m timing")
    for item in items:
        if "timing" in item.keywords:
            item.add_marker(skip)


# The openai-SDK conformance suite's wall time, printed at the end of every run (CI's log shows it):
# the issue that asked for the suite asked for its cost to stay visible.
CONFORMANCE = "test_openai_conformance.py"
_conformance = {"tests": 0, "seconds": 0.0}


def pytest_runtest_logreport(report):
    if CONFORMANCE in report.nodeid:
        _conformance["seconds"] += report.duration
        if report.when == "call":
            _conformance["tests"] += 1


def pytest_terminal_summary(terminalreporter):
    if _conformance["tests"]:
        terminalreporter.write_line(
            f"openai SDK conformance suite ({CONFORMANCE}): {_conformance['tests']} tests, "
            f"{_conformance['seconds']:.1f} s (setup, calls and teardown)"
        )
