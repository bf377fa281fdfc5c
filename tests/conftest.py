"""Shared fixtures: one tiny binarized En-De corpus per test session."""

import pytest

from tests.cli import tiny_translation_data


@pytest.fixture(scope="session")
def tiny_data_bin(tmp_path_factory):
    """fairseq-preprocess output for ~200 short multi30k pairs (word level, tiny vocab)."""
    return tiny_translation_data(tmp_path_factory.mktemp("tiny-en-de"))
