"""document_translation end to end with the real fairseq console scripts, on the fixture with
document boundaries (tests/fixtures/doc), using the paper's baseline: the stock transformer."""

import argparse

import pytest
import torch

pytest.importorskip("fairseq")
from fairseq import checkpoint_utils  # noqa: E402

# registered explicitly: fairseq's --user-dir import skips the package once a test imported it
import fairseq_plugins.tasks.document_translation  # noqa: E402,F401

from tests.cli import USER_DIR, generate, hypotheses, interactive, parse_bleu, train  # noqa: E402
from tests.document_fixture import FIXTURE, binarized_doc_fixture  # noqa: E402

pytestmark = pytest.mark.slow

DOC_ARGS = ["--task", "document_translation", "--context-tokens", "32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doc")
    data = binarized_doc_fixture(tmp)
    train(data, tmp / "ckpt", "transformer", DOC_ARGS, max_update=30)
    return data, tmp / "ckpt" / "checkpoint_last.pt"


def test_every_test_sentence_is_translated_once_against_its_own_reference(trained):
    data, checkpoint = trained
    out = generate(data, checkpoint, DOC_ARGS)
    references = (FIXTURE / "test.de").read_text().splitlines()
    assert sorted(hypotheses(out)) == list(range(len(references)))
    assert sum(line.startswith("H-") for line in out.splitlines()) == len(references)
    targets = {int(line.split("\t")[0][2:]): line.split("\t")[1]
               for line in out.splitlines() if line.startswith("T-")}  # fmt: skip
    for i, reference in enumerate(references):  # the current sentence only, never its context
        assert len(targets[i].split()) == len(reference.split())
        assert all(got in (want, "<<unk>>") for got, want in zip(targets[i].split(), reference.split()))
    parse_bleu(out)
    for mode in ("oracle-reference", "same-pass"):  # the default above: the model's own translations
        other = generate(data, checkpoint, DOC_ARGS + ["--target-context", mode])
        assert sorted(hypotheses(other)) == list(range(len(references)))


def test_interactive_accepts_context_joined_with_separators(trained):
    data, checkpoint = trained
    out = interactive(data, checkpoint, ["a man is walking .", "a dog runs . <s> a man is walking ."], DOC_ARGS)
    assert sorted(hypotheses(out)) == [0, 1]


def test_reference_context_is_forced_then_cut_from_the_output(trained):
    data, checkpoint = trained
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data), "user_dir": str(USER_DIR)}
    )
    task.cfg.target_context = "oracle-reference"
    task.load_dataset("test")
    dataset = task.dataset("test")
    batch = dataset.collater([dataset[i] for i in range(8)])
    context = batch["target_context"]
    assert context.size(1) > 0
    generator = task.build_generator(models, argparse.Namespace(beam=2))
    generator.max_len_b += context.size(1)
    with torch.no_grad():
        raw = generator.generate(models, batch, prefix_tokens=context)
    generator.max_len_b -= context.size(1)
    hypos = task.inference_step(generator, models, batch)
    pad = task.target_dictionary.pad()
    for row in range(len(raw)):
        prefix = context[row][context[row].ne(pad)]
        for full in raw[row]:
            assert torch.equal(full["tokens"][: len(prefix)], prefix)
        # the same hypotheses, cut after the prefix (and ranked by the current sentence's score)
        cut = sorted(tuple(full["tokens"][len(prefix):].tolist()) for full in raw[row])
        assert sorted(tuple(hypo["tokens"].tolist()) for hypo in hypos[row]) == cut
        assert all(len(hypo["positional_scores"]) == len(hypo["tokens"]) for hypo in hypos[row])
    with pytest.raises(ValueError, match="prefix-size"):
        task.inference_step(generator, models, batch, prefix_tokens=context[:, :1])


def test_samples_never_contain_other_documents_or_later_sentences(trained):
    data, _ = trained
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(trained[1])], arg_overrides={"data": str(data), "user_dir": str(USER_DIR), "context_tokens": 10_000}
    )
    task.load_dataset("train")
    dataset = task.dataset("train")
    docids = (FIXTURE / "train.docids").read_text().splitlines()
    src_lines = (FIXTURE / "train.en").read_text().splitlines()
    sep = task.source_dictionary.bos()
    for i in range(len(dataset)):
        joined = task.source_dictionary.string(dataset[i]["source"])  # drops the separators
        first = docids.index(docids[i])  # unbounded context: exactly the document so far
        expected = " ".join(src_lines[first : i + 1])
        n_sep = int(dataset[i]["source"].eq(sep).sum())
        assert n_sep == i - first
        assert len(joined.split()) == len(expected.split())
        assert all(got in (want, "<unk>") for got, want in zip(joined.split(), expected.split()))


def test_bpt_document_trains_and_translates_each_sentence_once(tmp_path):
    data = binarized_doc_fixture(tmp_path)
    train(data, tmp_path / "ckpt", "bpt_document", DOC_ARGS, max_update=20)
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    out = generate(data, checkpoint, DOC_ARGS)
    n_test = len((FIXTURE / "test.de").read_text().splitlines())
    assert sorted(hypotheses(out)) == list(range(n_test))
    parse_bleu(out)
    inter = interactive(data, checkpoint, ["a dog runs . <s> a man is walking ."], DOC_ARGS)
    assert sorted(hypotheses(inter)) == [0]


def test_chunk_samples_train_and_translate_every_sentence_once_against_its_reference(tmp_path):
    """--document-samples chunks (the original BPT code's samples): a chunk's sentences are
    translated together, and fairseq-generate prints and scores each test sentence once."""
    from sacrebleu.metrics import BLEU

    data = binarized_doc_fixture(tmp_path)
    args = DOC_ARGS + ["--document-samples", "chunks"]
    log = train(data, tmp_path / "ckpt", "transformer_document", args, max_update=20).stdout
    assert "samples (chunks, --context-tokens 32)" in log
    checkpoint = tmp_path / "ckpt" / "checkpoint_last.pt"
    references = (FIXTURE / "test.de").read_text().splitlines()
    for mode in ("translations", "same-pass"):
        out = generate(data, checkpoint, args + ["--target-context", mode])
        lines = out.splitlines()
        assert sum(line.startswith("H-") for line in lines) == len(references)
        hyps = hypotheses(out)
        assert sorted(hyps) == list(range(len(references)))
        targets = {int(line.split("\t")[0][2:]): line.split("\t")[1] for line in lines if line.startswith("T-")}
        for i, reference in enumerate(references):  # its own reference sentence, not its chunk
            assert len(targets[i].split()) == len(reference.split())
            assert all(got in (want, "<<unk>>") for got, want in zip(targets[i].split(), reference.split()))
        ordered = [hyps[i] for i in range(len(references))]
        expected = BLEU().corpus_score(ordered, [[targets[i] for i in range(len(references))]]).score
        assert parse_bleu(out) == pytest.approx(expected, abs=0.01)
