"""Every configuration the triton backend launches, compiled ahead of time for sm_80 and sm_90a
with the installed Triton (no GPU needed): at most 240 registers, zero register spills,
shared memory within the block limit, tensor cores for the tile kernels (the merges of split
blocks have no products: none is required of them). The other Triton versions that torch
pins are compiled by ``triton_budget`` (``.ci/run``; ``tests/test_triton_budget.py``).

The 350 compiles under Triton 3.7 and later (each target's launch table,
``triton_backend.launch_table``: 3 tile kernels x 3 dtypes x 3 head dims, each with and
without dropout and without and with relative keys and padding, ``triton_aot.variants``;
the dQ kernel's launch of the per-(row, type) sums alone where it has one, with and without
dropout; 3 merge kernels x 3 dtypes x 3 head dims, the dQ merge without and with relative
keys; the relative-key table and d rel_key's partial sums x 3 dtypes x 3 head dims and
their sum x 3 head dims; for 2 targets) run in two fresh processes
(``triton_aot.compile_all``): about 2.5 minutes on an idle 2-core machine.
``test_triton_backend`` checks that the backend launches these configurations (and, with
one of relative keys and padding, binaries that differ from them only in those two).
Skipped without Triton; ``triton_aot`` needs no GPU but Triton's bundled ptxas (or
``TRITON_PTXAS_PATH``).
"""

import pytest
import torch

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import triton_aot  # noqa: E402


# 128 x 64 tiles at head dim 128 on 4 warps: the fp32 accumulators alone need 128 registers a
# thread, ptxas uses all 255 and spills (about 700 B); compiled in the same processes as the table
OVERSIZED = triton_aot.Configuration("forward", "float16", 128, 128, 64, 4, 2, False)


# session-scoped, and the module's tests on one xdist worker: a module-scoped fixture is
# torn down when the worker runs another module's tests in between, and computed again
pytestmark = pytest.mark.xdist_group("triton_compile")


@pytest.fixture(scope="session")
def reports():
    jobs = [(c, cc) for cc in sorted(triton_aot.TARGETS)
            for c in triton_aot.launched_configurations(cc)]
    return triton_aot.compile_all(jobs + [(OVERSIZED, 90)])


def test_every_launched_configuration_compiles_cleanly_for_sm80_and_sm90a(reports):
    from fairseq_plugins.graph_attention.triton_backend import GPU_DTYPES, HEAD_DIMS, splits_rel_sums

    launched = reports[:-1]
    splits = sum(splits_rel_sums(dtype, dim) for dtype in GPU_DTYPES for dim in HEAD_DIMS)
    # targets x ((tile kernels x dropout x (none, relative keys + padding) + merges + the
    # relative-key table and partial sums) x dtypes x head dims + the sums' launches x
    # dropout + the partial sums' sum x head dims)
    assert len(launched) == 2 * ((3 * 2 * 2 + 4 + 2) * 3 * 3 + splits * 2 + 3)
    bad = [f"{r.configuration} sm_{r.capability}: {'; '.join(r.problems())}"
           for r in launched if r.problems()]
    assert not bad, "\n".join(bad)
    assert all(r.blocks_per_sm >= 1 for r in launched)


def test_tensor_cores_are_required_of_every_kernel_with_products_and_only_of_those(reports):
    """The tile kernels use them (their report says True); the merges have no products, and
    their report says that none was required (None), not that it was found."""
    for r in reports[:-1]:
        merge = r.configuration.kernel in triton_aot.NO_PRODUCTS
        assert r.tensor_core is (None if merge else True), r.configuration
        assert (triton_aot.tensor_core_instruction(r.configuration, r.capability) is None) == merge


def test_an_oversized_configuration_fails_the_checks(reports):
    oversized = reports[-1]
    assert oversized.configuration == OVERSIZED
    assert oversized.spill_stores > 0 and oversized.registers > triton_aot.MAX_REGISTERS
    assert len(oversized.problems()) == 2  # over the register budget, and spilling


def test_an_interpreter_that_cannot_run_the_kernels_is_named_and_refused(monkeypatch):
    """Triton < 3.7's interpreter with numpy >= 2.4 fails on the kernels' loaded loop bounds:
    the backend refuses under it with the reason (the tests skip with it), and only then."""
    from fairseq_plugins.graph_attention import triton_backend
    from fairseq_plugins.graphs.binary_partition import bpt_graph

    problem = triton_backend.interpreter_problem
    assert "numpy 2.5.5" in problem("3.6.0", "2.5.5") and "Triton 3.6.0" in problem("3.6.0", "2.5.5")
    assert problem("3.7.1", "2.5.5") is None and problem("3.6.0", "2.3.5") is None
    assert problem("3.6.0+git1234", "2.4.0rc1") is not None
    graph = bpt_graph(8, 1)
    query = torch.zeros(1, 1, graph.num_nodes, 32)
    monkeypatch.setattr(triton_backend, "interpreted", lambda: True)
    monkeypatch.setattr(triton_backend, "interpreter_problem", lambda: "the reason")
    assert triton_backend.refuses(query, graph) == "the reason"
    monkeypatch.setattr(triton_backend, "interpreter_problem", lambda: None)
    assert triton_backend.refuses(query, graph) is None


def test_each_architecture_has_a_launch_table_with_the_same_tiles():
    """sm_8x GPUs run the sm_80 table, sm_90 and newer and the interpreter the sm_90a one,
    each with the changes of the installed Triton; every table launches every kernel, with
    the tiles of the one plan per dtype and head dim."""
    from fairseq_plugins.graph_attention import triton_backend

    sm80, sm90 = triton_backend.launch_table(80), triton_backend.launch_table(90)
    assert triton_backend.launch_table(86) == triton_backend.launch_table(89) == sm80
    assert triton_backend.launch_table(100) == triton_backend.launch_table(None) == sm90
    assert triton_backend.launch_table(90, "3.7.1") is triton_backend.CONFIGS
    for capability in (80, 90):
        for version in ("3.6.0", "3.7.1", "3.8.0", "3.9.0+git1234"):
            table = triton_backend.launch_table(capability, version)
            alone = "backward_query_rel_sums"  # where the dQ kernel's sums have a launch of their own
            assert {k for k in table if k[0] != alone} == {k for k in triton_backend.CONFIGS if k[0] != alone}
            assert {k for k in table if k[0] == alone} == {
                (alone, dtype, dim) for dtype in triton_backend.GPU_DTYPES for dim in triton_backend.HEAD_DIMS
                if triton_backend.splits_rel_sums(dtype, dim, version)}
            for key, config in table.items():
                tiles = sm90[key if key[0] != alone else ("backward_query", *key[1:])]
                assert (config.block_m, config.block_n) == (tiles.block_m, tiles.block_n), key
                assert config.max_registers in (None, triton_aot.MAX_REGISTERS)
        # a release's changes hold from it on, and change only their entries
        changed = {key for key, config in triton_backend.launch_table(capability, "3.8.0").items()
                   if config != triton_backend.launch_table(capability, "3.7.1")[key] and key[0] != alone}
        assert changed == set(triton_backend.TRITON_CHANGES[(3, 8)])
        later = triton_backend.launch_table(capability, "3.9.0+git1234")
        assert later == triton_backend.launch_table(capability, "3.8.0")
    assert sm80 != sm90 and triton_backend.REGISTER_CAP == triton_aot.MAX_REGISTERS
    # the merges (few registers) run uncapped
    assert all(c.max_registers is None for c in triton_aot.launched_configurations(90)
               if c.kernel in triton_aot.NO_PRODUCTS)
