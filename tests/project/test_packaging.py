"""A plain (non-editable) install ships the schedules and tuning logs inside the package."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a wheel built and installed, a fresh interpreter

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_runs(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("ce_tvm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    # every module of every subpackage (a package missing from pyproject's list is not shipped)
    sources = [p.relative_to(ROOT).as_posix() for p in (ROOT / "ce_tvm").rglob("*.py")]
    sources += [f"ce_tvm/schedules/{p.name}" for p in (ROOT / "schedules").glob("*.py")]
    missing = sorted(set(sources + ["ce_tvm/tuning_logs/__init__.py"]) - set(names))
    assert not missing, f"missing from {wheel.name}: {missing}"
    records = {f"ce_tvm/tuning_logs/{p.relative_to(ROOT / 'tuning_logs').as_posix()}"
               for p in (ROOT / "tuning_logs").rglob("*.json")}
    missing = records - set(names)
    assert not missing, f"tuning records not shipped: {sorted(missing)[:3]}"
    assert not any(n.startswith(("schedules/", "tests/")) for n in names)

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    code = (f"import ce_tvm, torch; assert ce_tvm.__file__.startswith({str(target)!r}), "
            "ce_tvm.__file__; "
            "x = torch.randn(3, 6); y = torch.tensor([0, 5, 2]); "
            "l = ce_tvm.cross_entropy_loss(x, y)[0]; "
            "torch.testing.assert_close(l[0], torch.nn.functional.cross_entropy(x, y)); "
            "print('installed ok')")
    env = {**os.environ, "PYTHONPATH": str(target), "CE_TVM_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and "installed ok" in done.stdout, done.stderr
