"""Whether this environment runs the Triton kernels under Triton's interpreter (the CPU tests of
the triton backend): the reason to skip them, empty when they run."""

from fairseq_plugins.graph_attention import triton_backend


def skip_reason() -> str:
    if not triton_backend.interpreted():
        return "needs TRITON_INTERPRET=1 (set by conftest without a GPU)"
    return triton_backend.interpreter_problem() or ""
