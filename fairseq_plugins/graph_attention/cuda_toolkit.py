"""The CUDA toolkit that builds the ``"cuda"`` backend's kernels, and why none can.

torch guesses the toolkit from ``CUDA_HOME``/``CUDA_PATH`` or else as the folder two levels
above the ``nvcc`` on ``PATH``; that guess is wrong wherever ``nvcc`` is a link or a wrapper
script outside the toolkit (``/usr/local/bin/nvcc`` running ``/usr/local/cuda-13.0/bin/nvcc``
gives ``/usr/local``, and the link step then fails with ``cannot find -lcudart``). Here the
toolkit is the one ``nvcc`` itself reports (its ``TOP`` in ``nvcc --dryrun``), checked for the
headers and the runtime library that the build needs, and handed to torch's build.

The architectures built for are chosen here too, before torch would (``build_target``): a
build is keyed by them, and torch's own choice without ``TORCH_CUDA_ARCH_LIST`` needs a GPU
(without one it fails with an ``IndexError``).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import torch

DEFAULT_CUDA_HOME = Path("/usr/local/cuda")  # where torch, too, looks when nvcc is not on PATH
DEFAULT_ARCHITECTURES = "8.0;9.0"  # A100 and H100, built for where no GPU is visible
RUNTIME_LIBRARIES = ("lib64/libcudart.so", "lib/libcudart.so", "targets/x86_64-linux/lib/libcudart.so")


def nvcc_toolkit(nvcc: str) -> Optional[Path]:
    """The toolkit folder of this ``nvcc`` as it reports it (it may be a wrapper), else the
    folder above its real path's ``bin/``."""
    try:
        command = [nvcc, "--dryrun", "-x", "cu", "-E", os.devnull]
        dry = subprocess.run(command, capture_output=True, text=True, timeout=60)
        top = re.search(r"^#\$ TOP=(.+)$", dry.stdout + dry.stderr, re.MULTILINE)
    except (OSError, subprocess.SubprocessError):
        top = None
    if top:
        return Path(top.group(1).strip()).resolve()
    real = Path(nvcc).resolve()
    return real.parent.parent if real.parent.name == "bin" else None


def find_cuda_home() -> Optional[Path]:
    """``CUDA_HOME`` (or ``CUDA_PATH``) when set; else the toolkit of the ``nvcc`` on ``PATH``;
    else ``/usr/local/cuda`` when it has ``bin/nvcc``; else None."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        return nvcc_toolkit(nvcc)
    return DEFAULT_CUDA_HOME if (DEFAULT_CUDA_HOME / "bin" / "nvcc").is_file() else None


def toolkit_problem(home: Optional[Path]) -> Optional[str]:
    """Why the toolkit at ``home`` cannot build the kernels, or None."""
    if home is None:
        return "nvcc not found (put the CUDA toolkit's bin/ on PATH or set CUDA_HOME)"
    if not (home / "bin" / "nvcc").is_file():
        return f"no bin/nvcc in the CUDA toolkit {home} (CUDA_HOME)"
    if not (home / "include" / "cuda_runtime.h").is_file():
        return f"no include/cuda_runtime.h in the CUDA toolkit {home}"
    if not any((home / library).is_file() for library in RUNTIME_LIBRARIES):
        return f"no libcudart.so in the CUDA toolkit {home} (lib64/ or lib/)"
    return None


def prepare_build() -> Optional[str]:
    """Point torch's extension build at the toolkit of ``find_cuda_home`` and return why the
    kernels cannot be built here (None: they can). Needs no GPU. Sets ``CUDA_HOME`` when unset,
    which the build's child process reads (``extension_build.BUILD_PROGRAM``), so that torch's
    own messages name that toolkit. torch's build module is not imported here: without a GPU its
    import logs "No CUDA runtime is found", a notice about this machine, not the build."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    home = find_cuda_home()
    problem = toolkit_problem(home)
    if problem is not None:
        return problem
    os.environ.setdefault("CUDA_HOME", str(home))
    cpp_extension = sys.modules.get("torch.utils.cpp_extension")
    if cpp_extension is not None:  # imported before: its build reads CUDA_HOME from here, at call time
        cpp_extension.CUDA_HOME = str(home)
    return None


def visible_architectures() -> str:
    """The visible GPUs' architectures as torch would build for them ("8.0;9.0+PTX": each
    capability, capped at the newest that this torch was built for, the newest with PTX), or
    "" without a GPU."""
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    if not capabilities:
        return ""
    supported = [tuple(divmod(int(arch.split("_")[1].rstrip("a")), 10)) for arch in torch.cuda.get_arch_list()
                 if arch.startswith("sm_")]
    newest = max(supported, default=max(capabilities))
    archs = sorted({f"{major}.{minor}" for major, minor in (min(c, newest) for c in capabilities)})
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"])


def build_target() -> Dict[str, str]:
    """What the CUDA kernels are built for: ``TORCH_CUDA_ARCH_LIST`` when set, else the
    visible GPUs' architectures, else ``DEFAULT_ARCHITECTURES``."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or visible_architectures() or DEFAULT_ARCHITECTURES
    return {"TORCH_CUDA_ARCH_LIST": archs}
