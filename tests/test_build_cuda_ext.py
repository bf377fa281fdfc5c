"""``scripts/build_cuda_ext.py`` on every machine a user has: it never fails set-up, says why it
built nothing, builds without a GPU for ``TORCH_CUDA_ARCH_LIST`` (default 8.0 and 9.0), and
finds the toolkit that ``nvcc`` belongs to even when ``nvcc`` is a wrapper outside it."""

import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from fairseq_plugins.graph_attention import cuda_backend, cuda_toolkit
from scripts import build_cuda_ext


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


def test_cpu_torch_builds_nothing_and_says_why(monkeypatch, clean_env, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert build_cuda_ext.main([]) == 0
    out = capsys.readouterr().out
    assert "built nothing, torch" in out and "is a CPU-only build" in out
    assert build_cuda_ext.main(["--require"]) == 1


def test_without_nvcc_it_builds_nothing_and_says_why(cuda_torch_without_gpu, capsys):
    assert build_cuda_ext.main([]) == 0
    assert "built nothing, nvcc not found" in capsys.readouterr().out
    assert build_cuda_ext.main(["--require"]) == 1


def test_without_gpu_it_builds_for_the_default_architectures(cuda_torch_without_gpu, monkeypatch, tmp_path,
                                                             capsys):
    toolkit = _fake_toolkit(tmp_path / "cuda")
    monkeypatch.setenv("PATH", str(toolkit / "bin"))
    seen = {}

    def load_extension(verbose=False):
        seen.update(archs=os.environ.get("TORCH_CUDA_ARCH_LIST"), home=cpp_extension.CUDA_HOME)

    monkeypatch.setattr(cuda_backend, "load_extension", load_extension)
    assert build_cuda_ext.main([]) == 0
    assert seen == {"archs": "8.0;9.0", "home": str(toolkit.resolve())}
    out = capsys.readouterr().out
    assert f"CUDA toolkit {toolkit.resolve()} for TORCH_CUDA_ARCH_LIST=8.0;9.0" in out and "done in" in out
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")  # the user's choice is kept
    assert build_cuda_ext.main([]) == 0 and seen["archs"] == "9.0a"


def test_a_failed_build_is_reported_not_fatal(cuda_torch_without_gpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CUDA_HOME", str(_fake_toolkit(tmp_path / "cuda")))

    def load_extension(verbose=False):
        raise RuntimeError("Error building extension 'fairseq_plugins_graph_attention_cuda'\n"
                           "/usr/bin/ld: cannot find -lcudart")

    monkeypatch.setattr(cuda_backend, "load_extension", load_extension)
    assert build_cuda_ext.main([]) == 0
    out = capsys.readouterr().out
    assert "cannot find -lcudart" in out and "built nothing, the build failed" in out
    assert build_cuda_ext.main(["--require"]) == 1


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
