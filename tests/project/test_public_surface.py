"""The package's public names: each in ``__all__`` resolves (imported on first
use), ``dir(ce_tvm)`` lists each once before and after, and a name that is not
there raises ``AttributeError``."""

import subprocess
import sys

import pytest

CODE = """
import ce_tvm
before = dir(ce_tvm)
assert len(before) == len(set(before)), before
for name in ce_tvm.__all__:
    assert getattr(ce_tvm, name) is not None, name
after = dir(ce_tvm)
assert len(after) == len(set(after)), after
assert set(ce_tvm.__all__) <= set(before) and set(ce_tvm.__all__) <= set(after)
assert {"distributed", "testing"} <= set(after)
try:
    ce_tvm.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
"""


@pytest.mark.slow  # a process
def test_public_names_resolve_and_are_listed_once():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
