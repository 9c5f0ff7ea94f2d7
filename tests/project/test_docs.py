"""Every page's Python blocks run as written.

README.md and each page of docs/ with ```python blocks: the blocks of one page, in
order, concatenated (they build on each other), run in one fresh interpreter
outside the repository, so that ``import ce_tvm`` finds the installed package as a
user's script would. Pages about ranks (``TORCHRUN``) run under ``torchrun`` with
that many processes.
"""

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # processes: every page's blocks in a fresh interpreter, torchrun

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
TORCHRUN = {"docs/distributed.md": 2}
# A gloo worker thread can free the last collective's tensors while the interpreter
# finalises: it cannot take the GIL and the rank aborts with this line, after the page
# ran (a PyTorch race, about one run in five here). A rank that printed END finished
# the page; the run counts when every rank did.
EXIT_RACE = "terminate called without an active exception"
END = "ce-tvm page: every block ran"


def python_blocks(page: str) -> list[str]:
    return BLOCK.findall((ROOT / page).read_text())


PAGES = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md"))
                        if python_blocks(str(p.relative_to(ROOT))))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run_as_written(page, tmp_path):
    code = "\n".join(python_blocks(page))
    script = tmp_path / f"page_{Path(page).stem}.py"  # not a package's name (trl.py)
    script.write_text(f"{code}\nprint({END!r}, flush=True)\n" if page in TORCHRUN else code)
    for _ in range(5):  # a torchrun page again only after gloo's exit race
        command = [sys.executable, str(script)]
        if page in TORCHRUN:
            command[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node",
                            str(TORCHRUN[page]), "--master-port", str(_free_port())]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
        if page not in TORCHRUN or EXIT_RACE not in done.stderr:
            break
        if done.stdout.count(END) == TORCHRUN[page]:  # every rank ran the page to its end
            return
    numbered = "\n".join(f"{i:4} {line}" for i, line in enumerate(code.splitlines(), 1))
    assert done.returncode == 0, (
        f"{page}'s python blocks failed (exit {done.returncode}).\n"
        f"--- code (the blocks, concatenated) ---\n{numbered}\n"
        f"--- stdout ---\n{done.stdout[-5000:]}\n--- stderr ---\n{done.stderr[-8000:]}")
