#!/usr/bin/env python
"""Build the fused graph-attention CUDA kernels into the per-user cache (set-up step).

Never fatal: without a CUDA build of torch or a CUDA toolkit, or when the build fails, it says
why it built nothing and exits 0, since the models then run on the other backends. ``--require``
turns that into an error (exit 1). The toolkit is the one ``nvcc`` reports (``CUDA_HOME`` when
set; see ``fairseq_plugins/graph_attention/cuda_toolkit.py``). A GPU is not needed: without a
visible one it builds for the architectures in ``TORCH_CUDA_ARCH_LIST`` (default "8.0;9.0",
A100 and H100); with one, for the visible GPUs unless ``TORCH_CUDA_ARCH_LIST`` is set.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_ARCHS = "8.0;9.0"


def target_architectures() -> str:
    """What torch will build for, setting ``TORCH_CUDA_ARCH_LIST`` when no GPU is visible and
    it is unset (torch would otherwise fail looking for a GPU to build for)."""
    import torch

    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        if torch.cuda.device_count() > 0:
            return "the visible GPUs (set TORCH_CUDA_ARCH_LIST to choose)"
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
    return f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}"


def build(verbose: bool = False) -> str:
    """Build the kernels; returns why nothing was built, or "" when they were."""
    from fairseq_plugins.graph_attention import cuda_backend
    from fairseq_plugins.graph_attention.cuda_toolkit import prepare_build
    from torch.utils import cpp_extension

    reason = prepare_build()
    if reason is not None:
        return reason
    print(f"build_cuda_ext: building with the CUDA toolkit {cpp_extension.CUDA_HOME} for "
          f"{target_architectures()} into {cuda_backend.build_directory()} (minutes the first time) ...",
          flush=True)
    start = time.time()
    try:
        cuda_backend.load_extension(verbose=verbose)
    except Exception as error:  # a failed build is reported, never fatal (see the module doc)
        tail = "\n".join(str(error).strip().splitlines()[-20:])
        print(f"build_cuda_ext: {type(error).__name__}: {tail}", flush=True)
        return f"the build failed after {time.time() - start:.0f} s ({type(error).__name__}, shown above)"
    print(f"build_cuda_ext: done in {time.time() - start:.0f} s")
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true",
                        help="exit 1 instead of 0 when nothing could be built")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)

    reason = build(args.verbose)
    if reason:
        print(f"build_cuda_ext: built nothing, {reason}; graph attention will not use the "
              "CUDA kernels (the other backends run).")
        return 1 if args.require else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
