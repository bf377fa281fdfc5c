"""Whether this torch traces ``graph_attention`` into a compiled graph (``registry.TRACEABLE_FROM``):
the tests that compile with ``fullgraph=True`` need it."""

import pytest
import torch

from fairseq_plugins.graph_attention import registry

TRACEABLE = registry.release(torch.__version__) >= registry.TRACEABLE_FROM
needs_traceable_op = pytest.mark.skipif(
    not TRACEABLE, reason=f"torch {torch.__version__} runs graph_attention outside compiled graphs "
                          f"(traced from {registry.TRACEABLE_FROM})")
