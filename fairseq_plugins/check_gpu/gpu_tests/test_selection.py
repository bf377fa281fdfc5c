"""``backend="auto"`` on the device: whatever it picks, for every dtype and head dim (the fast
backends' own and one they do not take), matches float64, and it picks a registered backend.

    python -m pytest --pyargs fairseq_plugins.check_gpu.gpu_tests.test_selection
"""

import os

import pytest
import torch

from fairseq_plugins.check_gpu import kernel_checks
from fairseq_plugins.graph_attention import registry
from fairseq_plugins.graphs.binary_partition import bpt_graph

DEVICE = os.environ.get("FAIRSEQ_PLUGINS_CHECK_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("dim", [32, 48, 64, 128])
def test_auto_picks_a_backend_that_matches_float64(dim, dtype):
    graph = bpt_graph(300, 4)
    picked = registry.DEFAULT.auto(torch.zeros(1, 1, graph.num_nodes, dim, device=DEVICE, dtype=dtype), graph)
    print(f"auto on {DEVICE} / {dtype} / head dim {dim}: {picked}")
    kernel_checks.check_against_float64("auto", graph, [300, 120], dtype, dim, DEVICE)
