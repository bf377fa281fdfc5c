"""Every plugin model through fairseq's hub interface, and checkpoints bound to their dictionaries.

Uses the tiny checkpoints of tests/fixtures/checkpoints (written before the dictionary
fingerprint existed, with their dict.*.txt beside them).
"""

import shutil
from pathlib import Path

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.models.transformer import TransformerModel

from fairseq_plugins.models.dictionary_fingerprint import BUFFER, OVERRIDE, DictionaryMismatchError, fingerprint
from tests.cli import USER_DIR, hypotheses, run_cli
from tests.document_fixture import english_bpe_codes
from tests.models.test_checkpoint_compat import ARCHS, FIXTURES

SENTENCE = "The man, who works here, doesn't like the new cars."


@pytest.fixture(scope="module")
def bpe_codes(tmp_path_factory):
    return english_bpe_codes(tmp_path_factory.mktemp("bpe"))


def _hub(arch, bpe_codes):
    folder = FIXTURES / arch
    return ARCH_MODEL_REGISTRY[arch].from_pretrained(
        str(folder), checkpoint_file="checkpoint.pt", data_name_or_path=str(folder), user_dir=str(USER_DIR),
        tokenizer="moses", moses_no_escape=True, bpe="subword_nmt", bpe_codes=str(bpe_codes),
    )  # fmt: skip


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_from_pretrained_then_translate(arch, bpe_codes):
    hub = _hub(arch, bpe_codes)
    assert isinstance(hub.models[0], ARCH_MODEL_REGISTRY[arch])
    assert hub.tokenize(SENTENCE) == "The man , who works here , doesn 't like the new cars ."
    assert "@@" in hub.apply_bpe(hub.tokenize(SENTENCE))  # rare words split as in training
    out = hub.translate(SENTENCE)
    assert isinstance(out, str) and "@@" not in out
    assert hub.translate([SENTENCE, "the man ."])[0] == out  # batches give the same result


@pytest.mark.slow
def test_interactive_with_the_readme_flags_matches_the_hub(bpe_codes):
    """fairseq-interactive tokenizes raw text like the hub when given the README's flags."""
    arch = "bpt_transformer"
    folder = FIXTURES / arch
    out = run_cli(
        "fairseq-interactive", folder, "--user-dir", USER_DIR, "--path", folder / "checkpoint.pt",
        "--source-lang", "en", "--target-lang", "de", "--tokenizer", "moses", "--moses-no-escape",
        "--bpe", "subword_nmt", "--bpe-codes", bpe_codes, "--beam", "2", "--cpu", input=SENTENCE + "\n",
    ).stdout  # fmt: skip
    detok = [line.split("\t")[2] for line in out.splitlines() if line.startswith("D-")]
    assert detok == [_hub(arch, bpe_codes).translate(SENTENCE, beam=2)], out[-2000:]
    assert hypotheses(out)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_plugin_models_list_no_downloads(arch):
    assert TransformerModel.hub_models()  # the stock transformer's WMT checkpoints
    assert ARCH_MODEL_REGISTRY[arch].hub_models() == {}


def _load(checkpoint: Path, data: Path):
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data)})
    return models[0], task


def _fingerprinted_copy(arch, tmp_path) -> Path:
    """The fixture checkpoint re-saved by the current code (which records the fingerprint)."""
    folder = FIXTURES / arch
    model, _ = _load(folder / "checkpoint.pt", folder)
    state = checkpoint_utils.load_checkpoint_to_cpu(str(folder / "checkpoint.pt"))
    assert BUFFER not in state["model"]  # written before fingerprints: it still loads
    state["model"] = model.state_dict()
    dest = tmp_path / "checkpoint.pt"
    torch.save(state, dest)
    return dest


def _reordered_dictionary(arch, tmp_path, lang) -> Path:
    """The fixture's dictionaries with two words of one side swapped: same size, other order."""
    data = tmp_path / "data"
    shutil.copytree(FIXTURES / arch, data, ignore=shutil.ignore_patterns("*.pt"))
    lines = (data / f"dict.{lang}.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[3], lines[4] = lines[4], lines[3]
    (data / f"dict.{lang}.txt").write_text("".join(lines), encoding="utf-8")
    return data


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_checkpoint_records_and_checks_its_dictionaries(arch, tmp_path, monkeypatch):
    checkpoint = _fingerprinted_copy(arch, tmp_path)
    model, task = _load(checkpoint, FIXTURES / arch)
    expected = [fingerprint(task.source_dictionary), fingerprint(task.target_dictionary)]
    assert getattr(model, BUFFER).tolist() == expected

    data = _reordered_dictionary(arch, tmp_path, "de")
    with pytest.raises(DictionaryMismatchError, match=f"another target dictionary.*{OVERRIDE}=1"):
        _load(checkpoint, data)

    monkeypatch.setenv(OVERRIDE, "1")
    model, task = _load(checkpoint, data)
    assert getattr(model, BUFFER).tolist()[1] == fingerprint(task.target_dictionary) != expected[1]


@pytest.mark.slow
def test_fairseq_interactive_refuses_a_reordered_dictionary(tmp_path):
    arch = "bpt_transformer"
    checkpoint = _fingerprinted_copy(arch, tmp_path)
    data = _reordered_dictionary(arch, tmp_path, "en")
    with pytest.raises(RuntimeError) as err:
        run_cli("fairseq-interactive", data, "--user-dir", USER_DIR, "--path", checkpoint, "--source-lang", "en",
                "--target-lang", "de", "--cpu", input="the man .\n")  # fmt: skip
    assert "DictionaryMismatchError" in str(err.value) and "another source dictionary" in str(err.value)
