"""Every configuration the triton backend launches, compiled ahead of time for sm_80 and sm_90a
(no GPU needed): zero register spills, shared memory within the block limit, tensor cores.

The 108 compiles (``triton_backend.CONFIGS``: 3 kernels x 3 dtypes x 3 head dims, each with
and without dropout, for 2 targets) run in two fresh processes (``triton_aot.compile_all``):
about 3 minutes on a shared 2-core machine. ``test_triton_backend`` checks that the backend
launches exactly these configurations.
"""

import pytest

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import triton_aot  # noqa: E402


# 128 x 64 tiles at head dim 128 on 4 warps: the fp32 accumulators alone need 128 registers a
# thread, and ptxas spills (about 700 B); compiled in the same processes as the table
OVERSIZED = triton_aot.Configuration("forward", "float16", 128, 128, 64, 4, 2, False)


@pytest.fixture(scope="module")
def reports():
    jobs = [(c, cc) for cc in sorted(triton_aot.TARGETS)
            for c in triton_aot.launched_configurations()]
    return triton_aot.compile_all(jobs + [(OVERSIZED, 90)])


def test_every_launched_configuration_compiles_cleanly_for_sm80_and_sm90a(reports):
    launched = reports[:-1]
    assert len(launched) == 2 * 3 * 3 * 3 * 2  # targets x kernels x dtypes x head dims x dropout
    bad = [f"{r.configuration} sm_{r.capability}: {'; '.join(r.problems())}"
           for r in launched if r.problems()]
    assert not bad, "\n".join(bad)
    assert all(r.blocks_per_sm >= 1 for r in launched)


def test_an_oversized_configuration_fails_the_checks(reports):
    oversized = reports[-1]
    assert oversized.configuration == OVERSIZED
    assert oversized.spill_stores > 0 and oversized.problems()
