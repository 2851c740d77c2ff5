"""Task timelines on the GPU: a profiled run gives the same results, every task stamped once,
tasks on one CTA one after another, each CTA on one SM, and a chain's links in order."""
import numpy as np
import pytest
import tvm

from etc_tvm.build import build
from etc_tvm.tir_sched.persistent import KernelOptions

from test_executor import chain
from tiles import COLS, ROWS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ctas_per_sm", [1, 2])
@pytest.mark.parametrize("strategy", ["static", "dynamic", "mixed", "barrier"])
def test_a_profiled_chain_is_stamped_in_order(strategy, ctas_per_sm, rng):
    links = 64
    x = rng.standard_normal((links * ROWS, COLS)).astype("float32")
    compiled = build(chain, {"M": links * ROWS}, strategy=strategy,
                     options=KernelOptions(profile=True, ctas_per_sm=ctas_per_sm))
    out, timeline = compiled.profile(x)
    np.testing.assert_allclose(out, 2 * x.astype(np.float64) + 1, rtol=1e-6)
    spans = sorted(timeline.spans, key=lambda s: s.task)
    assert [s.task for s in spans] == list(range(links))
    for s in spans:
        assert 0 <= s.wait_us <= s.end_us - s.start_us
    for a, b in zip(spans, spans[1:]):  # link i+1 waits for link i's notify
        assert b.end_us >= a.end_us
    assert (timeline.handoffs_us() >= 0).all()  # one task at a time on each CTA
    for cta in {s.cta for s in spans}:  # a persistent CTA stays on its SM
        assert len({s.sm for s in spans if s.cta == cta}) == 1
    assert timeline.makespan_us > 0
    # every CTA stamps its entry, its prologue's end and its leaving around its own tasks
    num_ctas = tvm.cuda(0).multi_processor_count * ctas_per_sm
    assert sorted(c.cta for c in timeline.ctas) == list(range(num_ctas))
    for c in timeline.ctas:
        own = [s for s in spans if s.cta == c.cta]
        assert c.entered_us <= c.ready_us <= min((s.start_us for s in own), default=c.left_us)
        assert max((s.end_us for s in own), default=c.ready_us) <= c.left_us
        assert {s.sm for s in own} <= {c.sm}
    assert timeline.kernel_us > timeline.makespan_us
