"""``fairseq-plugins-build-kernels``: build ahead of time every compiled kernel this machine
can build (the set-up runs it), so that the first training compiles nothing.

It says, kernel by kernel, what it built or found built, and what it skipped and why; the
models run on the other backends without them. Exit status 1 when a build failed (the
compiler's last lines are shown), 0 otherwise (a kernel this machine cannot build, such as the
CUDA one under a CPU-only torch, is skipped, not failed).
"""

import sys
import time
from typing import Dict, List, Optional

from fairseq_plugins.command_line import command_parser
from fairseq_plugins.graph_attention import cpu_backend, cuda_backend
from fairseq_plugins.graph_attention.extension_build import Extension, say

#: the kernels, by backend name
KERNELS: Dict[str, Extension] = {"cpu": cpu_backend.EXTENSION, "cuda": cuda_backend.EXTENSION}


def build(kernels: Dict[str, Extension], verbose: bool = False) -> List[str]:
    """Build or load each kernel, saying what became of it; returns the backends that failed."""
    failed = []
    for backend, extension in kernels.items():
        reason = extension.requirement()
        if reason is not None:
            say(f"{backend}: skipped, {reason}")
            continue
        started = time.monotonic()
        try:
            module = extension.load(verbose)
        except Exception as error:  # a compiler error: reported, the other kernels still built
            say(f"{backend}: FAILED, {error}")
            failed.append(backend)
            continue
        say(f"{backend}: ready in {time.monotonic() - started:.0f} s ({module.__file__})")
    return failed


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser(
        prog="fairseq-plugins-build-kernels",
        description="Build every compiled kernel this machine can build into the kernel cache, and say "
                    "what was built, what was skipped and why.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = parser.parse_args(argv)
    failed = build(KERNELS, args.verbose)
    if failed:
        say(f"not built: {', '.join(failed)} (the other backends run instead)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
