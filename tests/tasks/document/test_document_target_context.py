"""Which target context document_translation decodes with: by default the model's own translations
of the preceding sentences (decoded in document order); the reference translations only as the
named oracle. A tiny checkpoint (tests/fixtures/checkpoints/transformer_document) translates the
first test documents of the document fixture, written straight into fairseq's binary format."""

import argparse
import shutil

import pytest
import torch

pytest.importorskip("fairseq")
from fairseq import checkpoint_utils  # noqa: E402
from fairseq.data import Dictionary, indexed_dataset  # noqa: E402

import fairseq_plugins.models  # noqa: E402,F401  (registers the models, as --user-dir does)
import fairseq_plugins.tasks  # noqa: E402,F401
from tests.cli import FIXTURES

CHECKPOINT = FIXTURES / "checkpoints" / "transformer_document"
DOC = FIXTURES / "doc"
N_SENTENCES = 22  # documents of 7, 3 and 12 sentences


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """test.en-de.{en,de} in fairseq's mmap format with the checkpoint's dictionaries, + docids."""
    out = tmp_path_factory.mktemp("doc-bin")
    for lang in ("en", "de"):
        shutil.copy(CHECKPOINT / f"dict.{lang}.txt", out / f"dict.{lang}.txt")
        dictionary = Dictionary.load(str(out / f"dict.{lang}.txt"))
        prefix = str(out / f"test.en-de.{lang}")
        builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(dictionary))
        for line in (DOC / f"test.{lang}").read_text().splitlines()[:N_SENTENCES]:
            builder.add_item(dictionary.encode_line(line, add_if_not_exist=False))
        builder.finalize(prefix + ".idx")
    docids = (DOC / "test.docids").read_text().splitlines()[:N_SENTENCES]
    (out / "test.docids").write_text("".join(d + "\n" for d in docids))
    return out


def _load(data, mode, context_tokens=40):
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(CHECKPOINT / "checkpoint.pt")], arg_overrides={"data": str(data), "context_tokens": context_tokens})
    task.cfg.target_context = mode
    task.load_dataset("test")
    generator = task.build_generator(models, argparse.Namespace(beam=2, max_len_a=0, max_len_b=6, min_len=2))
    return models, task, generator


def _record_prefixes(generator):
    """Wrap generator.generate to record the decoder prefix each sentence was given."""
    seen = {}
    generate = generator.generate

    def recording(models, sample, prefix_tokens=None, **kwargs):
        for row, sentence in enumerate(sample["id"].tolist()):
            prefix = prefix_tokens[row] if prefix_tokens is not None else torch.zeros(0, dtype=torch.long)
            seen[sentence] = prefix[prefix.ne(generator.pad)]
        return generate(models, sample, prefix_tokens=prefix_tokens, **kwargs)

    generator.generate = recording
    return seen


def _translate_all(task, models, generator, batch_size=4):
    dataset = task.dataset("test")
    batches = task.get_batch_iterator(dataset, max_sentences=batch_size).next_epoch_itr(shuffle=False)
    order, outputs = [], {}
    for sample in batches:
        hypos = task.inference_step(generator, models, sample)
        order.append(sample["id"].tolist())
        for sentence, row in zip(sample["id"].tolist(), hypos):
            outputs[sentence] = row[0]["tokens"]
    return order, outputs


def test_context_is_the_models_own_translation_of_the_preceding_sentences(data):
    models, task, generator = _load(data, "translations")
    prefixes = _record_prefixes(generator)
    order, outputs = _translate_all(task, models, generator)
    dataset, sep, eos = task.dataset("test"), task.sentence_separator, task.target_dictionary.eos()
    assert sorted(outputs) == list(range(N_SENTENCES))
    with_context = 0
    for i in range(N_SENTENCES):
        expected = []
        for j in range(int(dataset.context_start[i]), i):  # each translation without </s>, then <s>
            expected += [t for t in outputs[j].tolist() if t not in (eos, sep)] + [sep]
        assert prefixes[i].tolist() == expected
        with_context += any(t != sep for t in expected)
    assert with_context >= 10  # most sentences were decoded after translated context
    # document order: a batch never holds a sentence together with a sentence of its context
    done = set()
    for batch in order:
        for i in batch:
            assert set(range(int(dataset.context_start[i]), i)) <= done
        done |= set(batch)


def test_changing_a_translation_changes_the_next_sentences_context(data):
    models, task, generator = _load(data, "translations")
    _translate_all(task, models, generator)
    dataset = task.dataset("test")
    sentence = next(i for i in range(N_SENTENCES) if dataset.context_start[i] < i - 1)
    previous = sentence - 1
    words = task.target_dictionary
    replacement = torch.tensor([words.index("ein"), words.index("hund"), words.index(".")])
    assert words.unk() not in replacement.tolist()
    task.translations["test"][previous] = replacement
    prefixes = _record_prefixes(generator)
    task.inference_step(generator, models, dataset.collater([dataset[sentence]]))
    prefix = prefixes[sentence].tolist()
    assert prefix[-len(replacement) - 1:] == replacement.tolist() + [task.sentence_separator]


def test_oracle_reference_forces_the_reference_context(data):
    models, task, generator = _load(data, "oracle-reference")
    assert not task.dataset("test").document_order
    prefixes = _record_prefixes(generator)
    dataset = task.dataset("test")
    _translate_all(task, models, generator, batch_size=8)
    for i in range(N_SENTENCES):
        assert prefixes[i].tolist() == dataset[i]["target_context"].tolist()
    assert sum(len(p) > 0 for p in prefixes.values()) >= 15


def test_a_sentence_whose_context_was_not_translated_is_refused(data):
    models, task, generator = _load(data, "translations")
    dataset = task.dataset("test")
    sentence = next(i for i in range(N_SENTENCES) if dataset.context_start[i] < i)
    with pytest.raises(RuntimeError, match=f"needs the translation of sentence {sentence - 1}"):
        task.inference_step(generator, models, dataset.collater([dataset[sentence]]))


def test_obsolete_option_values_are_refused(data):
    _models, task, _generator = _load(data, "translations")
    cfg = task.cfg
    cfg.target_context_at_inference = "generated"
    with pytest.raises(ValueError, match="same-pass"):
        type(task)(cfg, task.source_dictionary, task.target_dictionary)
