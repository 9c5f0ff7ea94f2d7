"""What the pages say stays inside the repository and free of bookkeeping.

- every Markdown link of README.md and docs/ is relative, names a file of the
  repository, and, with ``#anchor``, a heading of that page (GitHub's anchors);
- no "session N" or "issue N" in the product, its docs, benchmarks or examples:
  measurements name the machine and the date.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
BOOKKEEPING = re.compile(r"\b(sessions?|issues?)\s+#?\d+", re.IGNORECASE)
PRODUCT = ("README.md", "docs", "ce_tvm", "schedules", "examples", "benchmarks")
TEXT_SUFFIXES = {".py", ".md", ".json", ".sh", ".c", ".txt", ".toml"}


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped,
    spaces to hyphens; repeats numbered)."""
    seen: dict[str, int] = {}
    result = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        result.add(slug if n == 0 else f"{slug}-{n}")
    return result


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_in_the_repository_and_resolve(page):
    text = FENCE.sub("", page.read_text())
    for target in LINK.findall(text):
        assert ":" not in target.split("#")[0], f"{page.name}: link leaves the repository: {target}"
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} names no file"
        assert ROOT in linked.parents or linked == ROOT, f"{page.name}: {target} is outside"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked), f"{page.name}: {target}: no such heading"
    assert "../shared" not in page.read_text(), f"{page.name} points outside the repository"


def product_files():
    for name in PRODUCT:
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        yield from (f for f in files if f.suffix in TEXT_SUFFIXES and "__pycache__" not in f.parts)


def test_no_bookkeeping_words_in_the_product():
    found = [f"{f.relative_to(ROOT)}:{n}: {line.strip()[:90]}"
             for f in product_files()
             for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if BOOKKEEPING.search(line)]
    assert not found, "sessions or issue numbers in the product:\n" + "\n".join(found)
