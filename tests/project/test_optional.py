"""Optional dependencies: without one, what needs it says which extra installs it.

Absence is simulated with ``sys.modules[name] = None`` (an import of ``name``
then fails as if it were not installed): in this process for the command
line (its ``main``, as the ``ce-tvm`` script calls it; it checks before it
measures anything), in a fresh interpreter for the transformers integration
(an import that must fail at the top of the module).
"""

import subprocess
import sys

import pytest

from ce_tvm.optional import MissingExtra, guard, require
from ce_tvm.tools.cli import main


def test_require_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra) as raised:
        require("matplotlib", "bench", "the chart", "pass --no-chart")
    assert str(raised.value) == ('the chart needs matplotlib, which is not installed: '
                                 'pip install "ce-tvm[bench]", or pass --no-chart')
    assert isinstance(raised.value, ModuleNotFoundError) and raised.value.name == "matplotlib"
    assert raised.value.__suppress_context__  # one error, not the import machinery's too


def test_guard_names_a_missing_part_of_an_installed_package():
    with pytest.raises(MissingExtra, match=r"needs numpy in a version the extra 'x' allows "
                       r"\(numpy [0-9.]+ is installed: cannot import name 'no_such_name'"):
        with guard("numpy", "x", "it"):
            from numpy import no_such_name  # noqa: F401


def test_guard_passes_other_import_errors_unchanged():
    with pytest.raises(ModuleNotFoundError) as raised:
        with guard("numpy", "x", "it"):
            import ce_tvm_no_such_module  # noqa: F401
    assert type(raised.value) is ModuleNotFoundError


@pytest.mark.parametrize("mode", [[], ["--linear"]], ids=["bench", "linear"])
def test_bench_png_without_matplotlib_is_one_line(mode, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    chart = tmp_path / "b.png"
    shapes = "8x4x16" if mode else "8x16"
    assert main(["bench", *mode, "--shapes", shapes, "--dtypes", "float32", "--reps", "1",
                 "--warmup", "0", "--no-compile", "--png", str(chart)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and not chart.exists()  # nothing measured: the check comes first
    assert err == ('ce-tvm bench: --png (the chart) needs matplotlib, which is not installed: '
                   'pip install "ce-tvm[bench]"\n')


def test_bench_policy_without_trl_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "trl", None)
    assert main(["bench", "--policy", "--shapes", "8x16", "--dtypes", "float32",
                 "--reps", "1", "--warmup", "0", "--no-compile"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ('ce-tvm bench: --policy (it compares against TRL) needs trl, which is not '
                   'installed: pip install "ce-tvm[trl]", or pass --no-trl\n')


@pytest.mark.slow  # a process
def test_transformers_integration_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; "
            "import ce_tvm.integrations.transformers")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ce_tvm.optional.MissingExtra: ce_tvm.integrations.transformers needs transformers, "
        'which is not installed: pip install "ce-tvm[transformers]"'), done.stderr
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr


@pytest.mark.slow  # a process
def test_torchtitan_integration_without_torchtitan():
    code = ("import sys; sys.modules['torchtitan'] = None; "
            "import ce_tvm.integrations.torchtitan")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ce_tvm.optional.MissingExtra: ce_tvm.integrations.torchtitan needs torchtitan, "
        'which is not installed: pip install "ce-tvm[torchtitan]"'), done.stderr
