"""The user extras are tested ranges, the test extra pins the versions CI runs inside
them, and installing an extra keeps an installed version that is in range; the torch
lower bound is the one docs/howto.md's version table gives."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

import ce_tvm

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
RANGED = ("transformers", "accelerate", "trl", "torchtitan")


def requirements(extra: str) -> dict:
    found = (Requirement(r) for r in EXTRAS[extra])
    return {r.name: r.specifier for r in found if r.name != "ce-tvm"}


@pytest.mark.parametrize("package", RANGED)
def test_user_extras_are_ranges_that_hold_the_tested_pin(package):
    user = {**requirements("transformers"), **requirements("trl"),
            **requirements("torchtitan")}[package]
    (pin,) = requirements("test")[package]
    assert pin.operator == "==", pin
    assert not any(s.operator == "==" for s in user), f"{package} {user}: a pin, not a range"
    assert user.contains(pin.version), f"the tested {package} {pin.version} is outside {user}"


def test_the_installed_versions_are_the_pins():
    for package in RANGED:
        (pin,) = requirements("test")[package]
        assert importlib.metadata.version(package) == pin.version, package


def test_installing_the_extras_keeps_installed_versions_in_range():
    """``pip install "ce-tvm[transformers,trl,torchtitan]"`` over an installed transformers,
    accelerate, TRL and torchtitan inside the ranges installs ce-tvm alone: nothing is
    downgraded."""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                           "--no-build-isolation", f"{ROOT}[transformers,trl,torchtitan]"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    would = [line for line in done.stdout.splitlines() if line.startswith("Would install")]
    assert would and would[0].split()[2:] == [f"ce-tvm-{ce_tvm.__version__}"], would


def test_the_torch_lower_bound_is_the_one_the_docs_table_declares():
    """pyproject's ``torch>=X`` and the torch row of docs/howto.md's version table agree
    (X is the lowest release benchmarks/torch_versions.sh passed)."""
    (torch,) = (r for r in map(Requirement, PROJECT["dependencies"]) if r.name == "torch")
    (bound,) = torch.specifier
    assert bound.operator == ">=", torch
    rows = (ROOT / "docs" / "howto.md").read_text().splitlines()
    (row,) = (line for line in rows if line.startswith("| torch |"))
    assert row.split("|")[2].strip() == f">= {bound.version}", row
