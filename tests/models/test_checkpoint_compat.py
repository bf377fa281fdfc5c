"""Checkpoints saved by earlier versions of the plugin still load and compute the same outputs.

``tests/fixtures/checkpoints/<arch>/`` holds, for each model, a tiny checkpoint written by the
real ``fairseq-train`` (two updates on the document fixture, 64-word dictionaries) with the
plugin as it was before the package layout changed, its dictionaries, and the decoder output
it gave then on a fixed batch (``expected.pt``). Regenerate them only on purpose, with the
code whose checkpoints are to be kept loadable:

    python -m tests.models.test_checkpoint_compat --write
"""

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests import cli
from tests.cli import USER_DIR, binarize, run_cli
from tests.document_fixture import FIXTURE as DOC_FIXTURE

FIXTURES = cli.FIXTURES / "checkpoints"
MODEL_ARGS = [
    "--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16",
    "--decoder-embed-dim", "16", "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
]  # fmt: skip
DOCUMENT_TASK = ["--task", "document_translation", "--context-tokens", "16"]
ARCHS = {
    "bpt_transformer": ["--graph-k", "2"],
    "segtree_transformer": [],
    "transformer_slowfast": ["--fast-embed-dim", "8", "--fast-ffn-embed-dim", "16", "--fast-attention-heads", "2"],
    "ms_transformer": [],
    "bpt_document": DOCUMENT_TASK,
    "transformer_document": DOCUMENT_TASK,
}


def _batch(dictionary):
    """A fixed source/target batch of two sentences, the second one padded (left, as fairseq)."""
    words = [dictionary.index(w) for w in dictionary.symbols[dictionary.nspecial:]][:24]
    pad, eos = dictionary.pad(), dictionary.eos()
    src = torch.tensor([words[:11] + [eos], [pad] * 4 + words[11:18] + [eos]])
    prev = torch.tensor([[eos] + words[3:12], [eos] + words[5:10] + [pad] * 4])
    return src, torch.tensor([12, 8]), prev


def _outputs(checkpoint: Path, data: Path) -> torch.Tensor:
    from fairseq import checkpoint_utils

    import fairseq_plugins.models  # noqa: F401  (registers the models, as --user-dir does)
    import fairseq_plugins.tasks  # noqa: F401

    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data)})
    model = models[0].eval()
    src, lengths, prev = _batch(task.source_dictionary)
    with torch.no_grad():
        logits, _ = model(src, lengths, prev)
    return logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_old_checkpoint_loads_and_gives_the_same_outputs(arch):
    folder = FIXTURES / arch
    torch.testing.assert_close(_outputs(folder / "checkpoint.pt", folder),
                               torch.load(folder / "expected.pt"), rtol=1e-5, atol=1e-5)


def write_fixtures() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = binarize(DOC_FIXTURE, Path(tmp) / "data-bin", ["--nwordssrc", "64", "--nwordstgt", "64"])
        for split in ("train", "valid", "test"):
            shutil.copy(DOC_FIXTURE / f"{split}.docids", data / f"{split}.docids")
        for arch, extra in ARCHS.items():
            save = Path(tmp) / arch
            run_cli(
                "fairseq-train", data, "--user-dir", USER_DIR, "-s", "en", "-t", "de",
                "--arch", arch, *MODEL_ARGS, *extra,
                "--optimizer", "adam", "--lr", "0.005", "--max-update", "2", "--max-tokens", "800",
                "--save-dir", save, "--no-save-optimizer-state", "--no-epoch-checkpoints",
                "--num-workers", "0", "--seed", "1", "--cpu", "--dropout", "0",
            )  # fmt: skip
            folder = FIXTURES / arch
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copy(save / "checkpoint_last.pt", folder / "checkpoint.pt")
            for name in ("dict.en.txt", "dict.de.txt"):
                shutil.copy(data / name, folder / name)
            torch.save(_outputs(folder / "checkpoint.pt", folder), folder / "expected.pt")
            print(f"wrote {folder}")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write_fixtures()
