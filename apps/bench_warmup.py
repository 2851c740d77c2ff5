"""From nothing to a first correct result at 64 batch sizes, and the steady state after.

A two-layer MLP (hidden 2048 -> 2048 -> 2048, bf16, the tiles of apps/bench_overhead.py, rows
in blocks of 16):

* etc_tvm: one ``build(..., max_dims={"M": 4096})`` (a static megakernel per power-of-two
  sample), ``export``, ``load``, then the first call at each batch size;
* what serving engines do: the same MLP in PyTorch (cuBLAS), one CUDA graph captured per batch
  size, then the first replay at each.

Every first result is checked against float64. Then the median latency of one call at
B = 1, 16, 256, 4096 for both (etc_tvm through its sample table, PyTorch replaying the graph
of that size). Prints one table and writes JSON (``--json``).
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import tvm
import tvm_ffi

from bench_overhead import make_mlp
from etc_tvm import build, load
from timing import time_interleaved

HIDDEN = INTER = 2048
BLOCK = 16


def batch_sizes(count: int, top: int) -> list[int]:
    """``count`` distinct sizes from 1 to ``top``, spread about evenly on a log scale."""
    assert count <= top, "more sizes than values"
    points = count
    while len(sizes := {int(round(v)) for v in np.geomspace(1, top, points)}) < count:
        points += 1  # rounding merges the small sizes: sample the scale more densely
    return sorted(sizes)[:count - 1] + [top]


def padded(b: int) -> int:
    return -(-b // BLOCK) * BLOCK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, default=64)
    parser.add_argument("--max", type=int, default=4096)
    parser.add_argument("--json", default="bench_warmup.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    w1 = (rng.standard_normal((HIDDEN, INTER)) / HIDDEN**0.5).astype(bf16)
    w2 = (rng.standard_normal((INTER, HIDDEN)) / INTER**0.5).astype(bf16)
    x_all = rng.standard_normal((padded(args.max), HIDDEN)).astype(bf16)
    sizes = batch_sizes(args.sizes, args.max)

    # float64 references, computed before any clock starts: checking is not warm-up
    tx64 = torch.from_numpy(x_all.astype(np.float64)).cuda()
    tw64 = [torch.from_numpy(w.astype(np.float64)).cuda() for w in (w1, w2)]
    h64 = torch.relu(tx64 @ tw64[0]).to(torch.bfloat16).double()  # the graph keeps h in bf16
    want_all = (h64 @ tw64[1]).cpu().numpy()
    del tx64, tw64, h64

    def check(label, b, got):
        want = want_all[:b]
        error = np.linalg.norm(got[:b].astype(np.float64) - want) / np.linalg.norm(want)
        assert error < 2e-2, f"{label}, B = {b}: relative error {error:.2e}"

    dev = tvm.cuda(0)
    with tvm_ffi.use_torch_stream():
        # etc_tvm: compile once, export, load, first call at every size
        torch.cuda.synchronize()
        start = time.perf_counter()
        mlp = make_mlp(BLOCK, HIDDEN, INTER)
        compiled = build(mlp, max_dims={"M": padded(args.max)})
        compile_s = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            compiled.export(Path(tmp) / "mlp.so")
            library = load(Path(tmp) / "mlp.so")
        weights = [tvm.runtime.tensor(w, dev) for w in (w1, w2)]
        for b in sizes:
            x = tvm.runtime.tensor(x_all[:padded(b)], dev)
            check("etc_tvm", b, library(x, *weights))
        torch.cuda.synchronize()
        etc_total = time.perf_counter() - start

        # PyTorch: one CUDA graph per batch size
        start = time.perf_counter()
        tw1, tw2 = (torch.from_numpy(w.view(np.int16)).view(torch.bfloat16).cuda()
                    for w in (w1, w2))
        tx_all = torch.from_numpy(x_all.view(np.int16)).view(torch.bfloat16).cuda()
        graphs = {}
        for b in sizes:
            xb = tx_all[:b]
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                for _ in range(3):
                    torch.relu(xb @ tw1) @ tw2
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = torch.relu(xb @ tw1) @ tw2
            graph.replay()
            check("torch graph", b, out.float().cpu().numpy())
            graphs[b] = (graph, out)
        torch.cuda.synchronize()
        torch_total = time.perf_counter() - start

        steady = []
        for b in (1, 16, 256, args.max):
            x = tvm.runtime.tensor(x_all[:padded(b)], dev)
            if b not in graphs:
                continue
            times = time_interleaved({"etc_tvm": lambda x=x: library.run(x, *weights),
                                      "torch graph": graphs[b][0].replay}, reps=100)
            steady.append({"B": b, **times})

        # the host's share of one call: choosing the sample that holds the inputs' sizes
        x = tvm.runtime.tensor(x_all[:padded(100)], dev)
        reps = 100_000
        start = time.perf_counter()
        for _ in range(reps):
            library.meta.select([x, *weights])
        select_us = (time.perf_counter() - start) / reps * 1e6

    print(f"\nfrom nothing to a first correct result at {len(sizes)} batch sizes (1..{args.max})")
    print(f"  etc_tvm (compile once: {compile_s:.1f} s, export, load, {len(sizes)} first "
          f"calls): {etc_total:.1f} s")
    print(f"  PyTorch, one CUDA graph per batch size ({len(sizes)} captures): "
          f"{torch_total:.1f} s")
    print(f"  choosing the sample on each call: {select_us:.2f} us on the host")
    print(f"\nsteady state, median us per call\n{'B':>6} {'etc_tvm':>10} {'torch graph':>12}")
    for r in steady:
        print(f"{r['B']:>6} {r['etc_tvm']:>10.1f} {r['torch graph']:>12.1f}")
    with open(args.json, "w") as f:
        json.dump({"sizes": sizes, "etc_compile_s": compile_s, "etc_total_s": etc_total,
                   "torch_total_s": torch_total, "select_us": select_us,
                   "steady": steady}, f, indent=1)


if __name__ == "__main__":
    main()
