"""The CUDA kernels compiled by g++ for the CPU under ``cuda_ext/csrc/host_emulation.h``.

The same ``graph_attention_kernels.cuh`` that nvcc compiles, run warp by warp with 32 lane
fibers per warp; bound like the CUDA extension, so ``cuda_backend.fused_graph_attention``
drives it unchanged. Built once into the extension cache (about a minute of one core).
"""

import shutil

import pytest
import torch
from torch.utils import cpp_extension

from fairseq_plugins.graph_attention import cuda_backend

SOURCE = cuda_backend.SOURCE_DIR / "host_emulation.cpp"
FLAGS = ("-O1", "-Wno-unknown-pragmas")


def build_directory():
    tag = f"host-emulation-torch{torch.__version__}".replace("+", "_")
    return cuda_backend.build_directory().parent / tag


def load_emulation():
    """The emulated extension (built on first use); skips the caller without a compiler."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler for the host emulation")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="fairseq_plugins_graph_attention_host_emulation", sources=[str(SOURCE)],
        extra_cflags=list(FLAGS), extra_include_paths=[str(cuda_backend.SOURCE_DIR)],
        build_directory=str(directory), verbose=False)
