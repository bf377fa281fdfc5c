"""The test tree mirrors the package (docs/layout.md, "Tests"): every test module is in a folder
of ``FOLDERS``, each folder stands for a part of the repository that exists, and the page
names each folder, so a new test file has one obvious place."""

import pytest

from tests.cli import REPO

TESTS = REPO / "tests"

# folder -> the part of the repository its tests are about (it must exist)
FOLDERS = {
    "graphs": "fairseq_plugins/graphs",
    "graph_attention": "fairseq_plugins/graph_attention",
    "modules": "fairseq_plugins/modules/common",
    "models": "fairseq_plugins/models",
    "models/bpt": "fairseq_plugins/modules/bpt",
    "models/slowfast": "fairseq_plugins/modules/slowfast",
    "models/multiscale": "fairseq_plugins/modules/multiscale",
    "tasks/lm": "fairseq_plugins/models/bpt_lm.py",
    "tasks/classification": "fairseq_plugins/tasks/sequence_tagging.py",
    "tasks/document": "fairseq_plugins/tasks/document_translation.py",
    "recipes": "fairseq_plugins/recipes",
    "scripts": "scripts",
    "check_gpu": "fairseq_plugins/check_gpu",
    "install": "fairseq_plugins/fairseq_build.py",
    "bad_input": "fairseq_plugins/command_line.py",
    "project": "docs/layout.md",
}


def _test_folders():
    return {path.parent.relative_to(TESTS).as_posix() for path in TESTS.rglob("test_*.py")
            if "fixtures" not in path.relative_to(TESTS).parts}


def test_no_test_module_sits_at_the_top_of_tests():
    assert sorted(path.name for path in TESTS.glob("test_*.py")) == []


def test_every_test_folder_is_a_known_one_and_a_package():
    folders = _test_folders() - {"."}  # the top: the test above
    assert sorted(folders - FOLDERS.keys()) == []
    for folder in folders:
        parts = folder.split("/")
        for depth in range(1, len(parts) + 1):  # tests.<folder>... imports as one package
            assert (TESTS.joinpath(*parts[:depth]) / "__init__.py").is_file(), folder


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_each_folder_stands_for_what_exists_and_is_documented(folder):
    assert (REPO / FOLDERS[folder]).exists(), FOLDERS[folder]
    assert f"`tests/{folder}/`" in (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
