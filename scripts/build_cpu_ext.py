#!/usr/bin/env python
"""Build the fused graph-attention CPU kernel (``cpu_ext/``) into the per-user cache (set-up).

Never fatal: without a C++ compiler with OpenMP it says why and exits 0, and the models use
the torch backend; ``--require`` makes that exit 1.
Later processes load the cached build in well under a second.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true", help="fail when it cannot be built")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    from fairseq_plugins.graph_attention import cpu_backend

    start = time.time()
    print(f"build_cpu_ext: {cpu_backend.EXTENSION.build_directory()} (about a minute the "
          "first time) ...", flush=True)
    try:
        cpu_backend.load_extension(verbose=args.verbose)
    except Exception as error:  # no compiler, no OpenMP: the torch backend remains
        print(f"build_cpu_ext: not built ({type(error).__name__}: {error}); graph attention "
              "on CPU will use the torch backend.")
        return 1 if args.require else 0
    print(f"build_cpu_ext: done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
