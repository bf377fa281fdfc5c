"""The CUDA kernels' toolkit and targets on every machine a user has: the toolkit that ``nvcc``
belongs to even when ``nvcc`` is a wrapper outside it, why none can build, and the
architectures a build is for and keyed by (``TORCH_CUDA_ARCH_LIST``, else the visible GPUs',
else sm_80 and sm_90, built for real with nvcc on a machine without a GPU)."""

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from fairseq_plugins.graph_attention import cuda_toolkit
from fairseq_plugins.graph_attention.extension_build import Extension


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _fake_toolkit(root: Path) -> Path:
    """A folder with what the build checks for; its nvcc reports it as ``TOP`` like nvcc does."""
    _executable(root / "bin" / "nvcc", f'#!/bin/sh\necho "#$ TOP={root}/bin/.."\n')
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("")
    (root / "lib64").mkdir()
    (root / "lib64" / "libcudart.so").write_text("")
    return root


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No CUDA variables, an empty PATH, no default toolkit, torch's CUDA_HOME restored after."""
    for variable in ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST"):  # set by the code under test: restored
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setattr(cuda_toolkit, "DEFAULT_CUDA_HOME", tmp_path / "no-cuda")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)


@pytest.fixture
def cuda_torch_without_gpu(monkeypatch, clean_env):
    """A CUDA build of torch that sees no GPU (as on a login node or in a container build)."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _gpus(monkeypatch, *capabilities, built_for=("sm_80", "sm_90")):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capabilities[i])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(built_for))


def test_the_target_is_the_variable_else_the_gpus_else_sm80_and_sm90(monkeypatch, clean_env):
    _gpus(monkeypatch)
    assert cuda_toolkit.build_target() == {"TORCH_CUDA_ARCH_LIST": "8.0;9.0"}
    _gpus(monkeypatch, (9, 0))  # an H100: what torch itself would pick
    assert cuda_toolkit.build_target() == {"TORCH_CUDA_ARCH_LIST": "9.0+PTX"}
    _gpus(monkeypatch, (9, 0), (8, 0), (9, 0))
    assert cuda_toolkit.build_target() == {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}
    _gpus(monkeypatch, (12, 0), built_for=("sm_80", "sm_90a"))  # newer than this torch: capped, as torch does
    assert cuda_toolkit.build_target() == {"TORCH_CUDA_ARCH_LIST": "9.0+PTX"}
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert cuda_toolkit.build_target() == {"TORCH_CUDA_ARCH_LIST": "8.6"}


def test_without_a_gpu_nvcc_builds_for_sm80_and_sm90(clean_env, monkeypatch, tmp_path):
    """The real build path, through torch's build and nvcc, where torch alone would fail with an
    IndexError looking for a GPU. With a CPU-only torch the link fails (no CUDA libraries of
    torch): the compilation, which chose the architectures, is what is checked."""
    nvcc = Path("/usr/local/cuda/bin/nvcc")
    if not nvcc.is_file():
        pytest.skip("no CUDA toolkit at /usr/local/cuda")
    monkeypatch.setenv("CUDA_HOME", str(cuda_toolkit.nvcc_toolkit(str(nvcc))))
    monkeypatch.setenv("PATH", os.environ.get("PATH", "") + ":/usr/bin:/bin")
    monkeypatch.setenv("FAIRSEQ_PLUGINS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    source = tmp_path / "tiny_kernel.cu"
    source.write_text("__global__ void tiny_kernel(float *x) { x[0] = 1.0f; }\n")
    extension = Extension("tiny_cuda", "tiny", "tag", (source,), target=cuda_toolkit.build_target)
    try:
        extension.load()
    except RuntimeError as error:
        assert torch.version.cuda is None and "IndexError" not in str(error), error
    directory = extension.build_directory()
    assert directory == extension.build_directory({"TORCH_CUDA_ARCH_LIST": "8.0;9.0"})
    assert (directory / "build" / "tiny_kernel.cuda.o").stat().st_size > 0
    ninja = (directory / "build" / "build.ninja").read_text()
    assert "-gencode=arch=compute_80,code=sm_80" in ninja and "-gencode=arch=compute_90,code=sm_90" in ninja


def test_the_toolkit_is_the_one_a_wrapper_nvcc_runs(clean_env, monkeypatch, tmp_path):
    """/usr/local/bin/nvcc running /usr/local/cuda-X/bin/nvcc: torch would guess /usr/local."""
    toolkit = _fake_toolkit(tmp_path / "cuda-13.0")
    wrapper = _executable(tmp_path / "local" / "bin" / "nvcc", f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    monkeypatch.setenv("PATH", str(wrapper.parent))
    assert cuda_toolkit.find_cuda_home() == toolkit.resolve()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert cuda_toolkit.prepare_build() is None
    assert cpp_extension.CUDA_HOME == str(toolkit.resolve())  # what torch's build then uses


def test_a_linked_nvcc_that_reports_nothing_resolves_to_its_toolkit(clean_env, monkeypatch, tmp_path):
    toolkit = tmp_path / "cuda-12.8"
    _executable(toolkit / "bin" / "nvcc", "#!/bin/sh\nexit 1\n")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").symlink_to(toolkit / "bin" / "nvcc")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert cuda_toolkit.find_cuda_home() == toolkit.resolve()
    assert "no include/cuda_runtime.h" in cuda_toolkit.toolkit_problem(toolkit)


def test_cuda_home_wins_and_is_checked(cuda_torch_without_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))
    assert cuda_toolkit.prepare_build() == f"no bin/nvcc in the CUDA toolkit {tmp_path / 'nowhere'} (CUDA_HOME)"


def test_the_real_nvcc_belongs_to_a_complete_toolkit():
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on PATH")
    home = cuda_toolkit.find_cuda_home()
    assert cuda_toolkit.toolkit_problem(home) is None, home
