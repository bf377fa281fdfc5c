"""The triton backend compiled and run on a CUDA GPU (skipped without one; ``python -m
fairseq_plugins.check_gpu`` runs it): the interpreter tests' cases against the same float64
CPU reference, in every launched dtype and head dim, with padding, split rows and dropout.

Without the interpreter bf16 goes through the GPU's own bf16 ``tl.dot`` and fp32 through
tf32x3, so this is the first check of both roundings; fp32 gets 1e-4 instead of the
interpreter's 2e-5 (three tf32 products recover about fp32's precision, not all of it)."""

import pytest
import torch

pytest.importorskip("triton")
from fairseq_plugins.graph_attention import triton_backend  # noqa: E402
from tests.test_triton_backend import GRAPHS, TOLERANCE, check  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or triton_backend.interpreted(),
                                 reason="needs a CUDA GPU and a compiling (not interpreted) triton")]

GPU_TOLERANCE = {**TOLERANCE, torch.float32: 1e-4}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("name", ["bpt-k1-n3", "bpt-k2-causal-n100", "segtree-n64", "random-tree-n40",
                                  "bpt-k4-n1000", "bpt-k1-n2049"])
def test_forward_and_gradients_match_the_reference_on_the_gpu(name, dim, dtype):
    build, lengths = GRAPHS[name]
    check(build(), lengths, dtype, dim=dim, device="cuda", tolerance=GPU_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_dropout_regenerates_the_mask_on_the_gpu(dtype):
    build, lengths = GRAPHS["bpt-k4-n257"]
    check(build(), lengths, dtype, dropout_p=0.3, dim=64, device="cuda", tolerance=GPU_TOLERANCE)
