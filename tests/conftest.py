"""Shared fixtures: one tiny binarized En-De corpus per test session."""

import os

import pytest
import torch

# Without a GPU, Triton kernels run on the CPU through its interpreter (read when the kernels
# are defined, so before any test imports them): tests/test_triton_backend.py
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# In-process tests call fairseq's parsers with --user-dir, which fairseq skips once any
# fairseq_plugins module is imported (as most tests do): register everything up front.
import fairseq_plugins.models  # noqa: F401
import fairseq_plugins.tasks  # noqa: F401
from tests.cli import tiny_translation_data


@pytest.fixture(scope="session")
def tiny_data_bin(tmp_path_factory):
    """fairseq-preprocess output for ~200 short multi30k pairs (word level, tiny vocab)."""
    return tiny_translation_data(tmp_path_factory.mktemp("tiny-en-de"))
