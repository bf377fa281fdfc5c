#!/usr/bin/env python
"""Build the fused graph-attention CUDA kernels into the per-user cache (set-up step).

Needs nvcc and a CUDA build of torch; without either it only says why it did nothing and
exits 0, since the models then run on the torch backend. ``--require`` turns that into an
error (exit 1). A GPU is not needed to build: set TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0")
to choose the architectures, otherwise torch builds for the visible GPU.
"""

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def missing_requirement():
    """Why the extension cannot be built here, or None."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true",
                        help="fail instead of skipping when nvcc or CUDA torch is missing")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)

    reason = missing_requirement()
    if reason is not None:
        print(f"build_cuda_ext: skipped, {reason}; graph attention will use the torch backend.")
        return 1 if args.require else 0

    from fairseq_plugins.graph_attention import cuda_backend

    print(f"build_cuda_ext: building into {cuda_backend.build_directory()} "
          "(a few minutes the first time) ...", flush=True)
    start = time.time()
    cuda_backend.load_extension(verbose=args.verbose)
    print(f"build_cuda_ext: done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
