"""The README's Python blocks run as written.

Every ```python block of README.md, in order, is concatenated and run in one fresh
interpreter (the blocks build on each other), outside the repository so that
``import ce_tvm`` finds the installed package as a user's script would.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_readme_python_blocks_run(tmp_path):
    blocks = readme_blocks()
    assert blocks, "README.md has no ```python block"
    code = "\n".join(blocks)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    numbered = "\n".join(f"{i:4} {line}" for i, line in enumerate(code.splitlines(), 1))
    assert done.returncode == 0, (
        f"README.md's python blocks failed (exit {done.returncode}).\n"
        f"--- code (the blocks, concatenated) ---\n{numbered}\n"
        f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}")
