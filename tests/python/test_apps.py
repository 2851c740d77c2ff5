"""The runnable apps run to completion (each checks its own results)."""
import importlib.util
import runpy
from pathlib import Path

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
