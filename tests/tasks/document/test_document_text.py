"""Raw document input: the sentence separator ``<s>`` survives fairseq's tokenizers and BPEs, in
fairseq-interactive, fairseq-generate on raw text and the hub, and the document models load
through the hub as the README shows."""

import argparse
import json
import subprocess
import sys

import pytest
import sentencepiece as spm
from fairseq.data import Dictionary

from fairseq_plugins.data.document_text import SentenceSeparated
from fairseq_plugins.tasks.document_translation import DocumentTranslationConfig, DocumentTranslationTask
from tests.cli import REPO, USER_DIR, generate, hypotheses, run_cli
from tests.document_fixture import FIXTURE as DOC_FIXTURE, english_bpe_codes
from tests.models.test_checkpoint_compat import FIXTURES

CONTEXT, SENTENCE = "A man, who works here, is riding a bike.", "He doesn't like the new cars."
LINE = f"{CONTEXT} <s> {SENTENCE}"
MOSES = ["--tokenizer", "moses", "--moses-no-escape"]
MOSES_ARGS = dict(tokenizer="moses", moses_source_lang="en", moses_target_lang="de", moses_no_dash_splits=False,
                  moses_no_escape=True)  # the options MOSES gives


@pytest.fixture(scope="module")
def bpe_codes(tmp_path_factory):
    return english_bpe_codes(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    spm.SentencePieceTrainer.train(
        input=str(DOC_FIXTURE / "train.en"), model_prefix=str(prefix), vocab_size=120, model_type="bpe",
        minloglevel=2,
    )  # fmt: skip
    return prefix.with_suffix(".model")


def _bpe_args(name, bpe_codes, sentencepiece_model):
    if name == "subword_nmt":
        return dict(bpe="subword_nmt", bpe_codes=str(bpe_codes), bpe_separator="@@")
    return dict(bpe="sentencepiece", sentencepiece_model=str(sentencepiece_model),
                sentencepiece_enable_sampling=False, sentencepiece_alpha=None)


def _task():
    dictionary = Dictionary.load(str(FIXTURES / "bpt_document" / "dict.en.txt"))
    return DocumentTranslationTask(DocumentTranslationConfig(), dictionary, dictionary)


def _encode(task, line, tokenizer_args, bpe_args):
    tokenizer = task.build_tokenizer(argparse.Namespace(**tokenizer_args))
    bpe = task.build_bpe(argparse.Namespace(**bpe_args))
    text = bpe.encode(tokenizer.encode(line))
    return text, task.source_dictionary.encode_line(text, add_if_not_exist=False)


@pytest.mark.parametrize("bpe_name", ["subword_nmt", "sentencepiece"])
def test_each_sentence_is_encoded_alone_and_the_separator_stays_a_token(bpe_name, bpe_codes, sentencepiece_model):
    task = _task()
    bpe_args = _bpe_args(bpe_name, bpe_codes, sentencepiece_model)
    text, tokens = _encode(task, LINE, MOSES_ARGS, bpe_args)
    context_text, _ = _encode(task, CONTEXT, MOSES_ARGS, bpe_args)
    sentence_text, _ = _encode(task, SENTENCE, MOSES_ARGS, bpe_args)
    assert text == f"{context_text} <s> {sentence_text}"
    separator = len(context_text.split())
    assert tokens.eq(task.sentence_separator).nonzero().flatten().tolist() == [separator]
    # and back: decoding keeps the sentences apart
    bpe = task.build_bpe(argparse.Namespace(**bpe_args))
    tokenizer = task.build_tokenizer(argparse.Namespace(**MOSES_ARGS))
    assert tokenizer.decode(bpe.decode(text)) == f"{CONTEXT} <s> {SENTENCE}"


def test_a_stray_or_doubled_separator_adds_no_empty_sentence():
    upper = SentenceSeparated(argparse.Namespace(encode=str.upper, decode=str.lower), "<s>")
    assert upper.encode("<s> a b <s><s> c ") == "A B <s> C"
    assert upper.encode("a b") == "A B"


def _interactive(lines, *flags):
    folder = FIXTURES / "bpt_document"
    return run_cli(
        "fairseq-interactive", folder, "--user-dir", USER_DIR, "--path", folder / "checkpoint.pt",
        "--source-lang", "en", "--target-lang", "de", "--task", "document_translation", "--beam", "2", "--cpu",
        *flags, input="".join(line + "\n" for line in lines),
    ).stdout  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("bpe_name", ["subword_nmt", "sentencepiece"])
def test_interactive_on_raw_text_equals_interactive_on_encoded_text(bpe_name, bpe_codes, sentencepiece_model):
    """The README's flags on raw `context <s> sentence` translate exactly what the same text,
    tokenized and BPE-encoded sentence by sentence beforehand, translates without them."""
    task = _task()
    bpe_args = _bpe_args(bpe_name, bpe_codes, sentencepiece_model)
    flags = (["--bpe", "subword_nmt", "--bpe-codes", bpe_codes] if bpe_name == "subword_nmt"
             else ["--bpe", "sentencepiece", "--sentencepiece-model", sentencepiece_model])
    context, sentence = (_encode(task, text, MOSES_ARGS, bpe_args)[0] for text in (CONTEXT, SENTENCE))
    encoded = [f"{context} <s> {sentence}", sentence]  # each sentence encoded alone
    raw_out = _interactive([LINE, SENTENCE], *MOSES, *flags)
    encoded_out = _interactive(encoded)
    assert sorted(hypotheses(raw_out)) == [0, 1]
    # same source tokens, same search: the same hypothesis scores, token by token
    scores = lambda out: [line for line in out.splitlines() if line.startswith("P-")]  # noqa: E731
    assert scores(raw_out) == scores(encoded_out), raw_out[-2000:]


@pytest.mark.slow
def test_generate_on_raw_text_with_the_readme_flags(tmp_path, bpe_codes):
    """--dataset-impl raw: fairseq reads the text files as they are (the separator is never in
    them; the task joins the sentences), and the flags only decode the output."""
    raw = tmp_path / "raw"
    raw.mkdir()
    folder = FIXTURES / "bpt_document"
    for lang in ("en", "de"):
        (raw / f"test.en-de.{lang}").write_text((DOC_FIXTURE / f"test.{lang}").read_text())
        (raw / f"dict.{lang}.txt").write_text((folder / f"dict.{lang}.txt").read_text())
    (raw / "test.docids").write_text((DOC_FIXTURE / "test.docids").read_text())
    args = ["--task", "document_translation", "--dataset-impl", "raw", "-s", "en", "-t", "de", *MOSES,
            "--bpe", "subword_nmt", "--bpe-codes", bpe_codes]  # fmt: skip
    out = generate(raw, folder / "checkpoint.pt", args)
    n_test = len((DOC_FIXTURE / "test.en").read_text().splitlines())
    assert sorted(hypotheses(out)) == list(range(n_test))
    assert not any("<s>" in line for line in out.splitlines() if line.startswith(("H-", "D-")))


HUB_SCRIPT = """
import json, sys
from fairseq_plugins.models.{module} import {cls}

folder, user_dir, codes = sys.argv[1:4]
hub = {cls}.from_pretrained(
    folder, checkpoint_file="checkpoint.pt", data_name_or_path=folder, user_dir=user_dir,
    tokenizer="moses", moses_no_escape=True, bpe="subword_nmt", bpe_codes=codes)
tokens = hub.encode({line!r})
print(json.dumps({{
    "separators": tokens.eq(hub.src_dict.bos()).nonzero().flatten().tolist(),
    "context": len(hub.apply_bpe(hub.tokenize({context!r})).split()),
    "translation": hub.translate({line!r}, beam=2),
    "task": type(hub.task).__name__,
}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("module, cls", [("bpt_document", "BPTDocumentModel"),
                                         ("transformer_document", "DocumentTransformerModel")])
def test_document_models_load_through_the_hub_as_the_readme_shows(module, cls, bpe_codes):
    """In a fresh interpreter, as a user: import the model class, then from_pretrained with user_dir."""
    script = HUB_SCRIPT.format(module=module, cls=cls, line=LINE, context=CONTEXT)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(FIXTURES / module), str(USER_DIR), str(bpe_codes)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["task"] == "DocumentTranslationTask"
    assert result["separators"] == [result["context"]]
    assert isinstance(result["translation"], str) and "<s>" not in result["translation"]
