import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _private_module_cache(tmp_path_factory):
    """Compile into a cache private to this test session unless CE_TVM_CACHE is set.

    Every test in the session shares it, so each kernel is compiled once.
    """
    if "CE_TVM_CACHE" not in os.environ:
        os.environ["CE_TVM_CACHE"] = str(tmp_path_factory.mktemp("ce_tvm_cache"))
    yield


def pytest_collection_modifyitems(config, items):
    """Slow tests last, so ``-x`` stops on a cheap failure first."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
