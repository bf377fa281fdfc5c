"""Every configuration the triton backend launches, compiled ahead of time for sm_80 and sm_90a
(no GPU needed): zero register spills, shared memory within the block limit, tensor cores.

The 36 compiles run in two fresh processes (``triton_aot.compile_all``): about two minutes of
CPU in all (measured on a shared machine).
"""

import pytest

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import triton_aot  # noqa: E402


@pytest.fixture(scope="module")
def reports():
    jobs = [(c, cc) for cc in sorted(triton_aot.TARGETS)
            for c in triton_aot.launched_configurations()]
    return triton_aot.compile_all(jobs)


def test_every_launched_configuration_compiles_cleanly_for_sm80_and_sm90a(reports):
    assert len(reports) == 2 * 3 * 3 * 2  # targets x kernels x head dims x dtypes
    bad = [f"{r.configuration} sm_{r.capability}: {'; '.join(r.problems())}"
           for r in reports if r.problems()]
    assert not bad, "\n".join(bad)
    assert all(r.blocks_per_sm >= 1 for r in reports)


def test_an_oversized_configuration_fails_the_checks():
    """128 x 64 tiles at head dim 128 on 4 warps: the fp32 accumulators alone need 128
    registers a thread, and ptxas spills (about 700 B)."""
    configuration = triton_aot.Configuration("forward", "float16", 128, 4, 2)
    report, = triton_aot.compile_all([(configuration, 90, 128, 64)], workers=1)
    assert report.spill_stores > 0 and report.problems()
