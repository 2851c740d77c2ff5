"""The runnable apps run to completion (each checks its own results)."""
import importlib.util
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest

import etc_tvm
from cubin import NVCC
from etc_tvm.build import has_gpu
from etc_tvm.tiles import attention

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
    if has_gpu():
        assert "run from the exported scale_then_mix.so" in out
    elif etc_tvm.BUILD_ENV != etc_tvm.build_env.NO_COMPILER:
        assert "sm_90a machine code); no GPU here" in out


def test_readme_tour_runs(tmp_path):
    """The API tour in README.md is code that runs, and computes what it says."""
    readme = (APPS.parent / "README.md").read_text()
    tour = tmp_path / "tour.py"  # TVMScript reads the source of the functions it parses
    tour.write_text(readme.split("```python\n", 1)[1].split("```", 1)[0])
    scope = runpy.run_path(str(tour))
    assert (scope["y"] == 9).all() and scope["y"].shape == (64, 64)
    assert scope["dot"].startswith('digraph "graph"')


def test_bench_tiles_split_specs(monkeypatch):
    """bench_tiles' ``--attention-splits`` specs, a block's merge in parts and a split that
    appends among them (PyTorch, which the script times against, stood in by an empty module
    where it is not installed)."""
    if importlib.util.find_spec("torch") is None:
        torch = types.ModuleType("torch")
        torch.Tensor = object
        monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.syspath_prepend(str(APPS))
    split_options = load("bench_tiles").split_options
    heads = attention.QWEN3_30B_A3B
    assert split_options("256xmma64x2xm8", 1, 4096, heads) == {
        "chunk": 256, "engine": "mma", "sub": 64, "stages": 2, "merge_parts": 8}
    assert split_options("512xmma", 1, 4096, heads) == {
        "chunk": 512, "engine": "mma", "sub": None, "stages": 2}
    assert split_options("128x4xm2", 1, 4096, heads) == {
        "chunk": 128, "unroll": 4, "merge_parts": 2}
    chunk, parts = attention.choose_split(1, 16384, heads)
    assert (chunk, parts) == (512, 8)
    assert split_options("auto", 1, 16384, heads) == {
        "chunk": chunk, "engine": "mma", "sub": 64, "stages": 2, "merge_parts": parts}
    assert split_options("autoxm1", 1, 16384, heads)["merge_parts"] == 1
    assert split_options("autoxm1xa", 1, 16384, heads) == {
        "chunk": chunk, "engine": "mma", "sub": 64, "stages": 2, "merge_parts": 1,
        "append_in_split": True}
    assert split_options("128xmma64x2xa", 1, 4096, heads)["append_in_split"]


@pytest.mark.parametrize("probe", sorted(p.name for p in APPS.glob("*.cu")))
def test_probe_compiles_for_sm_90a(probe, tmp_path):
    """The CUDA probes (each run by hand on the H200, as its header says) build as written."""
    if NVCC is None:
        pytest.skip("needs nvcc")
    done = subprocess.run([NVCC, "-O3", "-arch=sm_90a", "-c", str(APPS / probe), "-o",
                           str(tmp_path / "probe.o")], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]


def test_sass_lines_gives_the_instruction_and_cuda_line_of_an_offset():
    """apps/sass_lines.py, which reads sanitizer reports back: the offset of each call of a
    bounded wait in a megakernel's SASS maps to that call and to a line of the generated
    CUDA that calls the wait; an offset that is no instruction maps to nothing."""
    if NVCC is None:
        pytest.skip("needs nvcc")
    sass_lines = load("sass_lines")
    source = sass_lines.megakernel("fan_in_row_sum", "barrier").cuda_source()
    kernel = "row_sum_megakernel_kernel"
    calls = [offset for function, offset, ins, _ in sass_lines.line_table(source)
             if function == kernel and ins.startswith("CALL") and "etc_wait" in ins]
    assert calls
    *found, missing = sass_lines.at_offsets(source, kernel, [*calls, calls[0] + 1])
    assert all("etc_wait" in ins and "etc_wait" in line for _, ins, line in found), found
    assert missing == (calls[0] + 1, "?", "")
