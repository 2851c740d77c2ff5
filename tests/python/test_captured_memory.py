"""``runtime.holding_allocations``: the memory a VM call allocates stays out of TVM's pool
while it is held, as a captured CUDA graph needs of the intermediates it launches on. Shown
on the CPU, whose VM pools its memory the same way."""
import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from etc_tvm.runtime import holding_allocations


@I.ir_module
class TwoSteps:
    @R.function
    def main(x: R.Tensor((1024,), "float32")):
        y = R.add(x, x)  # an intermediate: its storage goes back to the pool after the call
        return R.multiply(y, y)


def intermediate_addresses(vm, x) -> list[int]:
    """The addresses of the tensors one call allocates, read while the call runs."""
    addresses = []

    def note(_func, _symbol, before_run, result, *_args):
        if not before_run and isinstance(result, tvm.runtime.Tensor):
            addresses.append(result.data_ptr())
        return 0

    vm.set_instrument(note)
    vm["main"](x)
    vm.set_instrument(None)
    return addresses


def addresses_of_calls(vm, x, calls: int = 4) -> set[int]:
    return {a for _ in range(calls) for a in intermediate_addresses(vm, x)}


def test_held_allocations_are_not_lent_again():
    vm = relax.VirtualMachine(tvm.compile(TwoSteps, target="llvm"), tvm.cpu())
    x = tvm.runtime.tensor(np.arange(1024, dtype="float32"))
    pooled = addresses_of_calls(vm, x)
    assert len(pooled) < 4 * 2  # unheld, the pool lends the same memory to later calls

    with holding_allocations(vm) as held:
        out = vm["main"](x)
    np.testing.assert_array_equal(out.numpy(), (2 * np.arange(1024, dtype="float32")) ** 2)
    kept = {t.data_ptr() for t in held if isinstance(t, tvm.runtime.Tensor)}
    assert len(kept) == 2 and kept <= pooled  # the intermediate and the output
    assert not kept & addresses_of_calls(vm, x)

    del held, out
    assert kept & addresses_of_calls(vm, x)  # let go, they are back in the pool
