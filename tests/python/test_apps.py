"""The runnable apps run to completion (each checks its own results)."""
import importlib.util
import runpy
import subprocess
from pathlib import Path

import pytest

from cubin import NVCC

APPS = Path(__file__).resolve().parents[2] / "apps"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, APPS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart(capsys):
    load("quickstart").main()
    out = capsys.readouterr().out
    assert "task graph scale_then_mix (B=96): 24 tasks in 2 calls" in out
    assert out.count(": correct") == 3 + ("run from the exported" in out)


def test_readme_tour_runs(tmp_path):
    """The API tour in README.md is code that runs, and computes what it says."""
    readme = (APPS.parent / "README.md").read_text()
    tour = tmp_path / "tour.py"  # TVMScript reads the source of the functions it parses
    tour.write_text(readme.split("```python\n", 1)[1].split("```", 1)[0])
    scope = runpy.run_path(str(tour))
    assert (scope["y"] == 9).all() and scope["y"].shape == (64, 64)
    assert scope["dot"].startswith('digraph "graph"')


@pytest.mark.parametrize("probe", sorted(p.name for p in APPS.glob("*.cu")))
def test_probe_compiles_for_sm_90a(probe, tmp_path):
    """The CUDA probes (each run by hand on the H200, as its header says) build as written."""
    if NVCC is None:
        pytest.skip("needs nvcc")
    done = subprocess.run([NVCC, "-O3", "-arch=sm_90a", "-c", str(APPS / probe), "-o",
                           str(tmp_path / "probe.o")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
