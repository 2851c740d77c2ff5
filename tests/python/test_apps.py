"""The runnable apps run to completion (each checks its own results)."""
import importlib.util
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
