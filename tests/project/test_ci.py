"""CI lints and tests with the README's commands, word for word."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_commands():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith((".venv/bin/ruff", ".venv/bin/python -m pytest"))]
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(ci) == 2 and "ruff check" in ci[0]  # the lint first, then the tests
    assert [line for line in ci if line not in readme] == []
