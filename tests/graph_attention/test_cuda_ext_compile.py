"""The CUDA sources must compile (no GPU needed): nvcc for sm_80, sm_90 (what
``fairseq-plugins-build-kernels`` builds without a GPU) and sm_90a, g++ for the binding.

Warnings are errors for our code (torch's headers are system includes), and so are register
spills; static shared memory stays within the 48 KiB a kernel may use without opting in. The
kernels are warp-per-row gathers on FMAs and shuffles, with no tensor-core instructions
(docs/cuda_ext.md says why; the Triton backend is the tensor-core path). Torch's CPU wheel
ships the ATen/cuda and c10/cuda headers except one generated one-line header, which is
recreated here when missing.
"""

import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from fairseq_plugins.graph_attention import cuda_backend

ARCHS = ("80", "90", "90a")
STATIC_SHARED_LIMIT = 48 * 1024
KERNELS = ("forward_kernel", "forward_merge_kernel", "backward_query_kernel",
           "backward_key_kernel", "backward_merge_kernel")
DTYPES = ("f", "N3c104HalfE", "N3c108BFloat16E")  # mangled float / c10::Half / c10::BFloat16


def _nvcc():
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    pytest.skip("nvcc not found (install the CUDA toolkit or put nvcc on PATH)")


def _include_flags(tmp_path, nvcc: Path):
    """torch, Python and CUDA headers as system includes; our own sources normally."""
    system = list(cpp_extension.include_paths())
    torch_include = Path(system[0])
    if not (torch_include / "c10/cuda/impl/cuda_cmake_macros.h").is_file():
        shim = tmp_path / "shim"
        (shim / "c10/cuda/impl").mkdir(parents=True)
        (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text(
            "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        system.insert(0, str(shim))
    system += [sysconfig.get_paths()["include"], str(nvcc.parent.parent / "include")]
    flags = [f"-I{cuda_backend.SOURCE_DIR}"]
    for path in system:
        flags += ["-isystem", path]
    return flags


def _abi_flag():
    import torch

    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _run(cmd):
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_kernels_compile_for_sm80_sm90_and_sm90a(tmp_path):
    nvcc = _nvcc()
    source = cuda_backend.SOURCES[1]
    cmd = [
        str(nvcc), "-c", str(source), "-o", str(tmp_path / "kernels.o"),
        "-std=c++20", _abi_flag(), "-Xcompiler", "-fPIC,-Wall,-Werror",
        "-Werror", "all-warnings", "-Xptxas", "-v,--warn-on-spills,--warning-as-error",
        *cpp_extension.COMMON_NVCC_FLAGS, *cuda_backend.NVCC_FLAGS,
        *_include_flags(tmp_path, nvcc),
    ]
    for arch in ARCHS:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    log = _run(cmd)
    assert (tmp_path / "kernels.o").stat().st_size > 0
    # every kernel is instantiated for every dtype, head dim and architecture
    compiled = set(re.findall(r"Compiling entry function '(\S+)' for 'sm_(\w+)'", log))
    for arch in ARCHS:
        for kernel in KERNELS:
            for dtype in DTYPES:
                for head_dim in (32, 64, 128):
                    pattern = re.compile(rf"{kernel}I{dtype}Li{head_dim}E")
                    assert any(pattern.search(name) and a == arch for name, a in compiled), (
                        f"{kernel}<{dtype}, {head_dim}> not compiled for sm_{arch}")
    assert "spill" not in log.replace("0 bytes spill stores, 0 bytes spill loads", "")
    assert re.search(r"Used \d+ registers", log)  # ptxas -v reports every kernel
    shared = [int(n) for n in re.findall(r"(\d+) bytes smem", log)]  # (only kernels that use any)
    assert max(shared, default=0) <= STATIC_SHARED_LIMIT, max(shared)


def test_binding_compiles(tmp_path):
    nvcc = _nvcc()
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cmd = [
        cxx, "-c", str(cuda_backend.SOURCES[0]), "-o", str(tmp_path / "binding.o"),
        "-std=c++20", "-fPIC", "-Wall", "-Wextra", "-Werror", _abi_flag(),
        "-DTORCH_EXTENSION_NAME=graph_attention_compile_test", "-DTORCH_API_INCLUDE_EXTENSION_H",
        *_include_flags(tmp_path, nvcc),
    ]
    _run(cmd)
    assert (tmp_path / "binding.o").stat().st_size > 0

