"""tests/gpu: correctness on the device, behind the `gpu` marker (python3 -m pytest -m gpu tests/gpu
-q). Every test here is marked `gpu` and skipped without CUDA."""

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cuda_clean():
    """Each test frees its device memory (the engines and pools of one test are not the next
    one's)."""
    yield
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def pair():
    """The embedded default pair (target, drafter) dirs; a test module may define its own `pair`."""
    from ddtree.assets import PACKAGE_PAIR

    target, drafter = os.path.join(PACKAGE_PAIR, "target"), os.path.join(PACKAGE_PAIR, "drafter")
    if not os.path.isdir(target):
        pytest.skip("no embedded pair in this checkout")
    return target, drafter
