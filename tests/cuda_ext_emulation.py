"""The CUDA kernels compiled by g++ for the CPU under ``cuda_ext/csrc/host_emulation.h``.

The same ``graph_attention_kernels.cuh`` that nvcc compiles, run warp by warp with 32 lane
fibers per warp, bound like the CUDA extension. Loading it registers it as the CPU kernel of
the CUDA backend's ops (``fairseq_plugins::cuda_graph_attention`` and its backward), so
``cuda_backend.fused_graph_attention`` on CPU tensors runs the kernels through the same ops,
autograd, fake implementations and dropout draw as on a GPU. Built once into the extension
cache (about a minute of one core).
"""

import functools
import shutil

import pytest
import torch

from fairseq_plugins.graph_attention import cuda_backend
from fairseq_plugins.graph_attention.extension_build import Extension

SOURCE = cuda_backend.SOURCE_DIR / "host_emulation.cpp"
# beside the CUDA extension's build; built under its build lock, so parallel test workers
# (pytest-xdist) build it once and a killed build does not make later loads wait forever
EMULATION = Extension(
    "fairseq_plugins_graph_attention_host_emulation", cuda_backend.EXTENSION.folder,
    f"host-emulation-torch{torch.__version__}", (SOURCE,), cflags=("-O1", "-Wno-unknown-pragmas"),
    include_dirs=(cuda_backend.SOURCE_DIR,))


@functools.lru_cache(maxsize=None)
def _build():
    emulation = EMULATION.load()
    # the CUDA ops' CPU kernels, for this process (no CPU build of them exists otherwise)
    cuda_backend.forward_op.register_kernel("cpu", functools.partial(cuda_backend.run_forward, emulation))
    cuda_backend.backward_op.register_kernel("cpu", functools.partial(cuda_backend.run_backward, emulation))
    return emulation


def load_emulation():
    """The emulated extension (built on first use), registered as the CPU kernel of the CUDA
    backend's ops; skips the caller without a compiler."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler for the host emulation")
    return _build()
