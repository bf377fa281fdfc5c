"""Sentence classifiers and the tagger: readouts, roots, word vectors, scorers, and the real CLIs + hub."""

from pathlib import Path

import pytest
import torch
from torch import nn

from fairseq.data import Dictionary

from fairseq_plugins.graphs.binary_partition import root_rows
from fairseq_plugins.models.bpt_classifier import BPTClassifierModel, SegTreeClassifierModel
from fairseq_plugins.models.ms_classifier import MultiScaleClassifierModel
from fairseq_plugins.models.transformer_classifier import TransformerClassifierModel
from fairseq_plugins.modules.common.pretrained_embeddings import load_pretrained, read_vectors
from fairseq_plugins.modules.common.sentence_readout import sentence_vector
from fairseq_plugins.recipes.evaluate_classification import evaluate as evaluate_runs
from fairseq_plugins.recipes.evaluate_classification import score_checkpoint
from fairseq_plugins.tasks.tagging_scores import f1, span_counts
from tests.classification_data import tags, write_classification, write_tagging
from tests.cli import FIXTURES, USER_DIR, run_cli

GLOVE = FIXTURES / "glove" / "tiny.8d.txt"
TINY = ["--encoder-layers", "2", "--encoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
        "--encoder-attention-heads", "2"]  # fmt: skip
MODELS = {"transformer_classifier": TransformerClassifierModel, "bpt_classifier": BPTClassifierModel,
          "segtree_classifier": SegTreeClassifierModel, "ms_classifier": MultiScaleClassifierModel}


# ---- readouts against a hand-built batch ---------------------------------------------------

def test_readouts_hand_built():
    # two sentences, 3 and 2 tokens (the second right-padded), 2 channels; time-first like fairseq
    states = torch.tensor([[[1.0, -1.0], [4.0, 0.0], [2.0, 5.0]],
                           [[0.0, 3.0], [-2.0, 1.0], [9.0, 9.0]]])  # B x T x C, [1, 2] is padding
    tokens = states.transpose(0, 1)
    padding = torch.tensor([[False, False, False], [False, False, True]])
    assert torch.equal(sentence_vector("cls", tokens, padding), torch.tensor([[1.0, -1.0], [0.0, 3.0]]))
    assert torch.equal(sentence_vector("max", tokens, padding), torch.tensor([[4.0, 5.0], [0.0, 3.0]]))
    assert torch.allclose(sentence_vector("mean", tokens, padding), torch.tensor([[7 / 3, 4 / 3], [-1.0, 2.0]]))
    assert torch.equal(sentence_vector("cls-max", tokens, padding),
                       torch.tensor([[1.0, -1.0, 4.0, 5.0], [0.0, 3.0, 0.0, 3.0]]))
    root = torch.tensor([[7.0, 7.0], [8.0, 8.0]])
    assert torch.equal(sentence_vector("root", tokens, padding, root), root)
    with pytest.raises(ValueError, match="tree"):
        sentence_vector("root", tokens, padding)


def test_root_rows_hand_built():
    # padded length 5: levels of 5, 3, 2, 1 nodes start at rows 0, 5, 8, 10
    assert root_rows(torch.tensor([1, 2, 3, 4, 5]), 5).tolist() == [0, 5, 8, 8, 10]
    with pytest.raises(ValueError, match="lengths"):
        root_rows(torch.tensor([6]), 5)


class _Task:
    def __init__(self, dictionary):
        self.source_dictionary = dictionary


def _tiny_model(model_cls, arch, dictionary, *extra):
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["/dev/null", "--user-dir", str(USER_DIR), "--arch", arch,
                                                "--task", "sentence_prediction", "--num-classes", "3",
                                                *TINY, "--dropout", "0", *extra])
    args.max_positions = 64
    return model_cls.build_model(args, _Task(dictionary)).eval()


@pytest.mark.parametrize("arch", ["bpt_classifier", "segtree_classifier"])
def test_root_readout_is_the_sentence_alone(arch):
    """The root read from a padded batch is the one the sentence gets alone (padding changes nothing),
    and it is not a token's state."""
    torch.manual_seed(0)
    d = Dictionary()
    for w in "abcdefg":
        d.add_symbol(w)
    model = _tiny_model(MODELS[arch], arch, d)
    short = torch.tensor([[5, 6, 7]])
    batch = torch.tensor([[5, 6, 7, d.pad(), d.pad()], [8, 9, 10, 5, 6]])
    with torch.no_grad():
        alone, out_alone = model(short, torch.tensor([3]))
        both, _ = model(batch, torch.tensor([3, 5]))
    assert torch.allclose(alone[0], both[0], atol=1e-5)
    assert not any(torch.allclose(alone[0], t, atol=1e-3) for t in out_alone["encoder_out"][0][:, 0])


# ---- word vectors --------------------------------------------------------------------------

def test_glove_reader_and_loading(tmp_path):
    vectors = read_vectors(GLOVE)
    assert len(vectors) == 16 and vectors["the"].shape == (8,)
    assert vectors["the"][0].item() == pytest.approx(0.68884)
    header = tmp_path / "w2v.txt"
    header.write_text("16 8\n" + GLOVE.read_text())
    assert read_vectors(header).keys() == vectors.keys()  # word2vec's header line is skipped
    d = Dictionary()
    for w in ("man", "zebra"):
        d.add_symbol(w)
    emb = nn.Embedding(len(d), 8)
    before = emb.weight[d.index("zebra")].clone()
    assert load_pretrained(emb, d, GLOVE) == 1
    assert torch.equal(emb.weight[d.index("man")].detach(), vectors["man"])
    assert torch.equal(emb.weight[d.index("zebra")].detach(), before)
    with pytest.raises(ValueError, match="--encoder-embed-dim 8"):
        load_pretrained(nn.Embedding(len(d), 4), d, GLOVE)
    bad = tmp_path / "bad.txt"
    bad.write_text("the 1 2 3\nman 1 2\n")
    with pytest.raises(ValueError, match="bad.txt:2"):
        read_vectors(bad)


# ---- span scoring ---------------------------------------------------------------------------

def test_span_f1_bio_as_conlleval():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "I-ORG", "O"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "I-ORG", "O", "O"]]
    assert span_counts(gold, pred) == (1, 3, 3)  # only PER matches: wrong type, wrong end
    # conlleval reads an I- after O as the start of an entity (IOB1 files)
    assert span_counts([["O", "I-PER", "I-PER"]], [["O", "B-PER", "I-PER"]]) == (1, 1, 1)
    assert f1(1, 3, 3) == pytest.approx(100 / 3)
    assert f1(0, 0, 5) == 0.0


def test_span_f1_bioes_strict():
    gold = [["S-PER", "O", "B-LOC", "E-LOC"]]
    assert span_counts(gold, gold, "BIOES") == (2, 2, 2)
    assert span_counts(gold, [["S-PER", "O", "B-LOC", "I-LOC"]], "BIOES") == (1, 1, 2)  # unfinished: no entity
    with pytest.raises(ValueError, match="length"):
        span_counts(gold, [["O"]], "BIOES")


# ---- the real command-line tools and the hub interface ---------------------------------------

def _train(data, save, *args):
    run_cli("fairseq-train", data, "--user-dir", USER_DIR, *TINY, "--optimizer", "adam", "--lr", "0.003",
            "--batch-size", "16", "--max-update", "40", "--save-dir", save, "--no-epoch-checkpoints",
            "--log-format", "simple", "--cpu", "--num-workers", "0", "--seed", "1", "--maximize-best-checkpoint-metric",
            *args)  # fmt: skip
    return save


SENTENCE_ARGS = ["--task", "sentence_prediction", "--criterion", "sentence_prediction", "--num-classes", "2",
                 "--init-token", "0", "--separator-token", "2", "--max-positions", "64",
                 "--best-checkpoint-metric", "accuracy"]  # fmt: skip


@pytest.fixture(scope="module")
def sentence_data(tmp_path_factory):
    return write_classification(tmp_path_factory.mktemp("sentences"))


@pytest.fixture(scope="module")
def trained_classifier(sentence_data, tmp_path_factory):
    """arch -> the save folder of that classifier trained on ``sentence_data``: each training run
    once per module, shared by the tests that read its checkpoint (none writes to the folder)."""
    saved = {}

    def trained(arch: str) -> Path:
        if arch not in saved:
            saved[arch] = _train(sentence_data, tmp_path_factory.mktemp(arch) / "ckpt", "--arch", arch,
                                 *SENTENCE_ARGS)
        return saved[arch]
    return trained


def _accuracy(hub, raw: Path, split="test", pairs=False):
    first = (raw / f"{split}.input0").read_text().splitlines()
    second = (raw / f"{split}.input1").read_text().splitlines() if pairs else [None] * len(first)
    gold = (raw / f"{split}.label").read_text().splitlines()
    got = [hub.predict_label(a, *([b] if b else [])) for a, b in zip(first, second)]
    return sum(g == p for g, p in zip(gold, got)) / len(gold)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_classifier_cli_and_hub(arch, sentence_data, trained_classifier):
    save = trained_classifier(arch)
    hub = MODELS[arch].from_pretrained(str(save), "checkpoint_best.pt", str(sentence_data), user_dir=str(USER_DIR))
    hub.eval()
    tokens = hub.encode("a man is riding a bike .")
    assert tokens[0].item() == 0 and tokens[-1].item() == 2  # --init-token, then the end of sentence
    logprobs = hub.predict("sentence_classification_head", tokens)
    assert logprobs.shape == (1, 2) and torch.allclose(logprobs.exp().sum(), torch.tensor(1.0))
    # 40 updates learn the rule (a person word or not) far above the majority class
    majority = max(0.5, sum(x == "other" for x in (sentence_data.parent / "raw" / "test.label").read_text().split())
                   / 40)
    accuracy = _accuracy(hub, sentence_data.parent / "raw")
    assert accuracy > majority
    # fairseq-plugins-evaluate's scorer (the task's batching over the binarized test set) agrees with the hub
    scored = score_checkpoint(save / "checkpoint_best.pt", sentence_data)
    assert scored["accuracy"] == pytest.approx(100 * accuracy)


@pytest.mark.slow
def test_sentence_pairs_and_frozen_glove(tmp_path):
    data = write_classification(tmp_path / "pairs", pairs=True)
    save = _train(data, tmp_path / "ckpt", "--arch", "bpt_classifier", *SENTENCE_ARGS, "--encoder-embed-dim", "8",
                  "--encoder-attention-heads", "2", "--encoder-embed-path", GLOVE, "--freeze-embeddings")
    hub = BPTClassifierModel.from_pretrained(str(save), "checkpoint_best.pt", str(data), user_dir=str(USER_DIR))
    pair = hub.encode("a man runs .", "a dog runs .")
    assert (pair == 2).sum().item() == 3  # end, separator, end: fairseq's ConcatSentencesDataset layout
    assert hub.predict_label("a man runs .", "a dog runs .") in {"same", "different"}
    weight = hub.model.encoder.embed_tokens.weight
    vectors = read_vectors(GLOVE)
    d = hub.task.source_dictionary
    assert torch.equal(weight[d.index("man")], vectors["man"])  # fixed through training
    assert not weight.requires_grad


def test_split_pair_hand_built():
    from fairseq_plugins.modules.common.sentence_pairs import pair_features, split_pair

    # <s>=0, pad=1, </s>=2: rows "<s> 5 6 </s> </s> 7 </s>" and "<s> 8 </s> </s> 9 10 11 </s>", right-padded
    rows = torch.tensor([[0, 5, 6, 2, 2, 7, 2, 1, 1], [0, 8, 2, 2, 9, 10, 11, 2, 1]])
    first, second = split_pair(rows, eos=2, pad=1)
    assert first.tolist() == [[0, 5, 6, 2], [0, 8, 2, 1]]
    assert second.tolist() == [[0, 7, 2, 1, 1], [0, 9, 10, 11, 2]]
    with pytest.raises(ValueError, match="needs sentence pairs"):
        split_pair(torch.tensor([[0, 5, 2, 1]]), eos=2, pad=1)
    r1, r2 = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 1.0]])
    assert pair_features(r1, r2).tolist() == [[1.0, -2.0, 3.0, 1.0, 2.0, 3.0, 3.0, -2.0]]


@pytest.mark.slow
def test_snli_pairs_encoded_separately_cli_and_hub(tmp_path):
    data = write_classification(tmp_path / "pairs", pairs=True, n_train=64, n_eval=16)
    # ms_classifier_snli defaults to --pair-encoding separate
    save = _train(data, tmp_path / "ckpt", "--arch", "ms_classifier_snli", *SENTENCE_ARGS)
    hub = MultiScaleClassifierModel.from_pretrained(str(save), "checkpoint_best.pt", str(data), user_dir=str(USER_DIR))
    hub.eval()
    model = hub.model
    assert model.cfg.pair_encoding == "separate"
    assert model.classification_heads["sentence_classification_head"].dense.in_features == 4 * 2 * 32
    pairs = [("a man runs .", "a dog runs on the grass ."), ("two women sit on a bench in the park .", "a girl .")]
    joined = [hub.encode(a, b) for a, b in pairs]
    batch = torch.full((2, max(map(len, joined))), hub.task.source_dictionary.pad())
    for i, row in enumerate(joined):
        batch[i, : len(row)] = row
    with torch.no_grad():
        got, _ = model(batch)
        for i, (a, b) in enumerate(pairs):  # each sentence alone, as a single sentence is read
            alone = [model._sentence_vectors(hub.encode(s).unsqueeze(0), None)[0] for s in (a, b)]
            want = torch.cat([alone[0], alone[1], (alone[0] - alone[1]).abs(), alone[0] * alone[1]], -1)
            torch.testing.assert_close(got[i : i + 1], want, rtol=1e-5, atol=1e-5)
    assert hub.predict_label(*pairs[0]) in {"same", "different"}
    scored = score_checkpoint(save / "checkpoint_best.pt", data)
    assert scored["accuracy"] == pytest.approx(100 * _accuracy(hub, data.parent / "raw", pairs=True))


@pytest.mark.slow
def test_sequence_shift_evaluation(sentence_data, trained_classifier, tmp_path):
    """BPT Table 2's test: n zero-embedding placeholders before each sentence, scored by the evaluation command."""
    from fairseq_plugins.recipes.config import load_config
    from fairseq_plugins.recipes.evaluate_classification import evaluate

    save = trained_classifier("bpt_classifier")
    checkpoint = save / "checkpoint_best.pt"
    hub = BPTClassifierModel.from_pretrained(str(save), "checkpoint_best.pt", str(sentence_data),
                                             user_dir=str(USER_DIR))
    hub.eval()
    raw = sentence_data.parent / "raw"
    sentences = (raw / "test.input0").read_text().splitlines()
    gold = (raw / "test.label").read_text().splitlines()
    labels = hub.task.label_dictionary
    embed = hub.model.encoder.embed_tokens
    first_logits = []
    for shift in (0, 3):
        # independently of the scorer: <unk> x shift in front, the embedding layer's output there set to zero
        hook = embed.register_forward_hook(lambda module, args, out, n=shift: out.index_fill(1, torch.arange(n), 0.0))
        unk = torch.full((shift,), hub.task.source_dictionary.unk())
        with torch.no_grad():
            logits = [hub.predict("sentence_classification_head", torch.cat([unk, hub.encode(s)]), return_logits=True)
                      for s in sentences]
        hook.remove()
        first_logits.append(logits[0])
        predicted = [labels[int(x.argmax()) + labels.nspecial] for x in logits]
        expected = 100 * sum(p == g for p, g in zip(predicted, gold)) / len(gold)
        assert score_checkpoint(checkpoint, sentence_data, shift=shift)["accuracy"] == pytest.approx(expected)
    assert not torch.allclose(*first_logits)  # the placeholders reach the encoder (a deeper tree, another root)
    cfg = load_config("bpt-table2:bpt-sst5-shift3")
    result = evaluate(cfg, sentence_data, [checkpoint], "test", tmp_path / "results")
    assert "shifted by 3 zero-embedding placeholders" in result["test_set"]
    assert result["accuracy"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="not options of the classification evaluation"):
        evaluate(dict(cfg, evaluate={"shfit": 3}), sentence_data, [checkpoint], "test", tmp_path / "results")


def test_bpt_table2_rows_score_table1s_runs():
    from fairseq_plugins.recipes.config import all_configs, load_tables, run_key, seed_configs

    configs = {c["name"]: c for c in all_configs()}
    table1 = configs["bpt-table1/bpt-sst5"]
    rows = sorted((c for c in configs.values() if c["table"] == "bpt-table2"), key=lambda c: c["evaluate"]["shift"])
    assert [c["evaluate"]["shift"] for c in rows] == list(range(8))
    assert [c["row"] for c in rows] == load_tables()["bpt-table2"]["rows"]
    for cfg in rows:  # no training of its own: the same 10 runs as Table 1's SST-5 row
        assert [run_key(r) for r in seed_configs(cfg)] == [run_key(r) for r in seed_configs(table1)]
    assert rows[0]["reported"]["accuracy"] == table1["reported"]["accuracy"] == 52.71


def test_separate_pair_encoding_needs_the_pair_layout(tmp_path):
    data = write_classification(tmp_path / "pairs", pairs=True, n_train=8, n_eval=4)
    at = SENTENCE_ARGS.index("--separator-token")
    args = SENTENCE_ARGS[:at] + SENTENCE_ARGS[at + 2:]
    with pytest.raises(Exception) as err:
        _train(data, tmp_path / "ckpt", "--arch", "ms_classifier_snli", *args, "--max-update", "1")
    assert "--pair-encoding separate" in str(err.value) and "--separator-token" in str(err.value)


@pytest.mark.slow
def test_tagger_cli_and_hub(tmp_path):
    data = write_tagging(tmp_path / "tags")
    out = run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--arch", "ms_tagger", *TINY,
                  "--task", "sequence_tagging", "--criterion", "sequence_tagging", "--tag-scheme", "BIO",
                  "--optimizer", "adam", "--lr", "0.005", "--batch-size", "16", "--max-update", "60",
                  "--save-dir", tmp_path / "ckpt", "--no-epoch-checkpoints", "--log-format", "simple", "--cpu",
                  "--num-workers", "0", "--seed", "1", "--best-checkpoint-metric", "f1",
                  "--maximize-best-checkpoint-metric").stdout  # fmt: skip
    assert "| f1 " in out and "| accuracy " in out
    hub = MultiScaleClassifierModel.from_pretrained(str(tmp_path / "ckpt"), "checkpoint_best.pt", str(data),
                                                    user_dir=str(USER_DIR))
    hub.eval()
    sentence = "a young man is sitting on a bench ."
    predicted = hub.predict_label(sentence)
    assert len(predicted) == len(sentence.split())
    assert set(predicted) <= {"O", "B-PER", "I-PER"}
    assert predicted == tags(sentence) or predicted.count("O") >= 5  # mostly O even when not yet exact
    # the evaluation command's scorer: token accuracy and span F1 from the same predictions as the hub's
    raw = tmp_path / "tags" / "raw"
    gold = [line.split() for line in (raw / "test.label").read_text().splitlines()]
    pred = [hub.predict_label(line) for line in (raw / "test.input0").read_text().splitlines()]
    cfg = {"name": "tagging_check", "table": "t", "row": "r", "column": "c", "data": "tiny", "seeds": 2}
    result = evaluate_runs(cfg, data, [tmp_path / "ckpt" / "checkpoint_best.pt"] * 2, "test", tmp_path / "results")
    words = sum(map(len, gold))
    assert result["accuracy"] == pytest.approx(100 * sum(g == p for gs, ps in zip(gold, pred) for g, p in zip(gs, ps))
                                               / words)
    assert result["f1"] == pytest.approx(f1(*span_counts(gold, pred)))
    assert result["f1_std"] == 0.0 and len(result["runs"]) == 2
    assert (tmp_path / "results" / "tagging_check.json").exists()


def test_char_ngrams_as_jmt_writes_them():
    from fairseq_plugins.modules.common.char_ngram_embedding import char_ngrams

    assert char_ngrams("ab") == ["2gram-#BEGIN#a", "2gram-ab", "2gram-b#END#", "3gram-#BEGIN#ab", "3gram-ab#END#",
                                 "4gram-#BEGIN#ab#END#"]
    assert len(char_ngrams("x")) == 2 + 1 + 0  # #BEGIN#x, x#END#; #BEGIN#x#END#; no 4-gram


def test_char_ngram_embedding_against_a_float64_reference(tmp_path):
    from fairseq_plugins.modules.common.char_ngram_embedding import CharNgramWordEmbedding, char_ngrams

    d = Dictionary()
    for word in ("cat", "cab", "a"):
        d.add_symbol(word)
    words = nn.Embedding(len(d), 3, padding_idx=d.pad()).double()
    emb = CharNgramWordEmbedding(words, d, 4).double()
    assert emb.embedding_dim == 7 and emb.padding_idx == d.pad() and emb.num_embeddings == len(d)
    tokens = torch.tensor([[d.index("cat"), d.index("a"), d.eos()], [d.index("cab"), d.unk(), d.pad()]])
    out = emb(tokens)
    row = {gram: i for i, gram in enumerate(emb.ngrams)}
    table = emb.ngram_embedding.weight
    for b in range(2):
        for t in range(3):
            word = d[int(tokens[b, t])]
            chars = (torch.stack([table[row[g]] for g in char_ngrams(word)]).mean(0)
                     if t == 0 or (b, t) == (0, 1) else torch.zeros(4, dtype=torch.float64))
            torch.testing.assert_close(out[b, t], torch.cat([words.weight[tokens[b, t]], chars]))
    assert row["2gram-ca"] and len(emb.ngrams) == 1 + len(set(char_ngrams("cat") + char_ngrams("cab") +
                                                             char_ngrams("a")))  # shared n-grams share a row
    # gradients reach each n-gram in proportion to its share of the mean
    out[0, 0, 3:].sum().backward()
    grad = emb.ngram_embedding.weight.grad
    torch.testing.assert_close(grad[row["2gram-ca"]], torch.full((4,), 1 / len(char_ngrams("cat")), dtype=grad.dtype))
    assert grad[row["2gram-ab"]].abs().sum() == 0 and grad[0].abs().sum() == 0
    # JMT's charNgram.txt start, in GloVe's text format
    vectors = tmp_path / "charNgram.txt"
    vectors.write_text("2gram-ca 1 2 3 4\n3gram-zzz 0 0 0 0\n")
    assert emb.load_ngram_vectors(vectors) == 1
    assert emb.ngram_embedding.weight[row["2gram-ca"]].tolist() == [1, 2, 3, 4]
    vectors.write_text("2gram-ca 1 2\n")
    with pytest.raises(ValueError, match="--char-ngram-dim is 4"):
        emb.load_ngram_vectors(vectors)


@pytest.mark.slow
def test_tagger_with_character_ngrams_cli_and_hub(tmp_path):
    from fairseq_plugins.modules.common.char_ngram_embedding import CharNgramWordEmbedding

    data = write_tagging(tmp_path / "tags", n_train=96, n_eval=24)
    ngrams = tmp_path / "charNgram.txt"
    ngrams.write_text("2gram-ma 1 1 1 1 1 1 1 1\n3gram-man 2 2 2 2 2 2 2 2\n")
    run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--arch", "ms_tagger", *TINY,
            "--char-ngram-dim", "8", "--char-ngram-path", ngrams,
            "--task", "sequence_tagging", "--criterion", "sequence_tagging", "--tag-scheme", "BIO",
            "--optimizer", "adam", "--lr", "0.005", "--batch-size", "16", "--max-update", "30",
            "--save-dir", tmp_path / "ckpt", "--no-epoch-checkpoints", "--log-format", "simple", "--cpu",
            "--num-workers", "0", "--seed", "1", "--best-checkpoint-metric", "f1",
            "--maximize-best-checkpoint-metric")  # fmt: skip
    hub = MultiScaleClassifierModel.from_pretrained(str(tmp_path / "ckpt"), "checkpoint_best.pt", str(data),
                                                    user_dir=str(USER_DIR))
    hub.eval()
    embed = hub.model.encoder.embed_tokens
    assert isinstance(embed, CharNgramWordEmbedding) and embed.embedding_dim == 32
    assert embed.word_embedding.embedding_dim == 24 and embed.ngram_embedding.embedding_dim == 8
    trained = embed.ngram_embedding.weight[embed.ngrams.index("3gram-man")]
    assert not torch.equal(trained, torch.full((8,), 2.0)) and trained.sub(2.0).abs().max() < 1.0  # started there
    sentence = "a young man is sitting on a bench ."
    assert len(hub.predict_label(sentence)) == len(sentence.split())
    raw = tmp_path / "tags" / "raw"
    gold = [line.split() for line in (raw / "test.label").read_text().splitlines()]
    pred = [hub.predict_label(line) for line in (raw / "test.input0").read_text().splitlines()]
    scored = score_checkpoint(tmp_path / "ckpt" / "checkpoint_best.pt", data)
    assert scored["f1"] == pytest.approx(f1(*span_counts(gold, pred)))
    with pytest.raises(RuntimeError, match="--char-ngram-path needs --char-ngram-dim"):
        run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--arch", "ms_tagger", *TINY,
                "--char-ngram-path", ngrams, "--task", "sequence_tagging", "--criterion", "sequence_tagging",
                "--optimizer", "adam", "--batch-size", "4", "--max-update", "1", "--cpu",
                "--save-dir", tmp_path / "none")


def test_tagging_rejects_words_without_tags(tmp_path):
    data = write_tagging(tmp_path / "tags", n_train=8, n_eval=4)
    raw = tmp_path / "tags" / "raw"
    lines = (raw / "train.label").read_text().splitlines()
    lines[3] = lines[3] + " O"
    (raw / "train.label").write_text("\n".join(lines) + "\n")
    run_cli("fairseq-preprocess", "--only-source", "--trainpref", raw / "train.label", "--destdir",
            data / "label", "--srcdict", data / "label" / "dict.txt", "--workers", "1")
    from fairseq_plugins.tasks.sequence_tagging import SequenceTaggingConfig, SequenceTaggingTask

    task = SequenceTaggingTask.setup_task(SequenceTaggingConfig(data=str(data), seed=1))
    with pytest.raises(ValueError, match="sentence 3 has a different number of words and tags"):
        task.load_dataset("train")


def test_results_table_renders_accuracy_with_its_deviation_and_tagging_rows(tmp_path):
    import json

    from fairseq_plugins.recipes.config import all_configs
    from fairseq_plugins.recipes.results_table import render

    configs = all_configs()
    bpt = next(c for c in configs if c["name"] == "bpt-table1/bpt-sst5")
    (tmp_path / "bpt-table1").mkdir(parents=True)
    (tmp_path / f"{bpt['name']}.json").write_text(json.dumps(
        {"accuracy": 51.234, "accuracy_std": 0.5, "test_set": "sst5-phrases test",
         "accuracy_signature": "mean of 10 run(s), standard deviation 0.50"}))
    text = render("bpt-table1", tmp_path)
    assert "| BPT | 52.71 | 51.23 | 92.12 | - |" in text and "standard deviation 0.50" in text
    pos = next(c for c in configs if c["name"] == "ms-table4/ms-ptb-pos")
    (tmp_path / "ms-table4").mkdir()
    (tmp_path / f"{pos['name']}.json").write_text(json.dumps(
        {"accuracy": 96.5, "test_set": "ptb-pos test", "accuracy_signature": "mean of 1 run(s)"}))
    row = next(line for line in render("ms-table4", tmp_path).splitlines()
               if line.startswith("| Multi-Scale Transformer |"))
    assert "| 97.24 | 96.50 | - | - |" in row  # PTB POS: accuracy ours beside the paper's; no F1 there


def test_crf_is_a_taggers_output_only():
    d = Dictionary()
    for w in "abc":
        d.add_symbol(w)
    model = _tiny_model(MultiScaleClassifierModel, "ms_tagger", d, "--crf")
    model.register_classification_head("tags", num_classes=3, token_level=True)
    assert model.classification_heads["tags"].crf.transitions.shape == (3, 3)
    with pytest.raises(ValueError, match="--crf is a tagger's output layer"):
        model.register_classification_head("sentence", num_classes=3)


@pytest.mark.slow
def test_crf_tagger_trains_on_its_likelihood_and_predicts_by_viterbi(tmp_path):
    import re

    from fairseq import checkpoint_utils

    from fairseq_plugins.tasks.sequence_tagging import IGNORE, SequenceTaggingCriterion

    data = write_tagging(tmp_path / "tags", n_train=96, n_eval=24)
    proc = run_cli("fairseq-train", data, "--user-dir", USER_DIR, "--arch", "ms_tagger", *TINY, "--crf",
                   "--task", "sequence_tagging", "--criterion", "sequence_tagging", "--tag-scheme", "BIO",
                   "--optimizer", "adam", "--lr", "0.005", "--batch-size", "16", "--max-update", "24",
                   "--save-dir", tmp_path / "ckpt", "--no-epoch-checkpoints", "--log-format", "simple",
                   "--log-interval", "1", "--cpu", "--num-workers", "0", "--seed", "1",
                   "--best-checkpoint-metric", "f1", "--maximize-best-checkpoint-metric")  # fmt: skip
    losses = [float(x) for x in re.findall(r"\| train_inner \|.*? loss=([\d.]+)", proc.stdout + proc.stderr)]
    assert len(losses) == 24 and sum(losses[-6:]) < 0.5 * sum(losses[:6])  # it learns
    checkpoint = tmp_path / "ckpt" / "checkpoint_best.pt"
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)],
                                                                   arg_overrides={"data": str(data)})
    model = models[0].eval()
    head = model.classification_heads["tagging_head"]
    assert head.crf.transitions.abs().sum() > 0  # trained
    # the criterion's loss is the CRF's negative log-likelihood, not the per-word cross-entropy
    task.load_dataset("valid")
    sample = task.dataset("valid").collater([task.dataset("valid")[i] for i in range(8)])
    with torch.no_grad():
        loss, sample_size, _ = SequenceTaggingCriterion(task)(model, sample)
        logits, _ = model(**sample["net_input"], classification_head_name="tagging_head")
        target = sample["target"]
        logits = logits[:, : target.size(1)]
        crf_nll = head.crf(logits, target, target.ne(IGNORE)).sum()
        cross_entropy = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=IGNORE,
                                                          reduction="sum")
    torch.testing.assert_close(loss, crf_nll)
    assert sample_size == int(target.ne(IGNORE).sum()) and not torch.isclose(loss, cross_entropy)
    # the evaluation's scorer and the hub decode by Viterbi: a CRF that only allows O moves every prediction
    raw = tmp_path / "tags" / "raw"
    gold = [line.split() for line in (raw / "test.label").read_text().splitlines()]
    assert score_checkpoint(checkpoint, data)["f1"] > 0
    state = torch.load(checkpoint, weights_only=False)
    other = [i for i in range(task.num_tags) if task.tag_strings([i]) != ["O"]]
    for name in ("transitions", "start"):
        key = f"classification_heads.tagging_head.crf.{name}"
        state["model"][key] = state["model"][key].index_fill(-1, torch.tensor(other), -1e4)
    torch.save(state, tmp_path / "ckpt" / "only_o.pt")
    scored = score_checkpoint(tmp_path / "ckpt" / "only_o.pt", data)
    words = sum(map(len, gold))
    assert scored["f1"] == 0 and scored["accuracy"] == pytest.approx(100 * sum(t == "O" for s in gold for t in s)
                                                                     / words)
    hub = MultiScaleClassifierModel.from_pretrained(str(tmp_path / "ckpt"), "only_o.pt", str(data),
                                                    user_dir=str(USER_DIR))
    sentence = "a young man is sitting on a bench ."
    assert hub.eval().predict_label(sentence) == ["O"] * len(sentence.split())


# ---- the originals' classification: words-only trees, input dropout ------------------------

def test_words_only_hand_built():
    from fairseq_plugins.modules.common.sentence_words import words_only

    # <s>=0, pad=1, </s>=2; the second row left-padded, the third with a placeholder (99) in front of <s>
    rows = torch.tensor([[0, 5, 6, 7, 2], [1, 1, 0, 8, 2], [99, 0, 9, 2, 1]])
    assert words_only(rows, bos=0, eos=2, pad=1).tolist() == [[5, 6, 7], [8, 1, 1], [99, 9, 1]]
    with pytest.raises(ValueError, match="nothing to encode"):
        words_only(torch.tensor([[0, 2], [0, 5]]), bos=0, eos=2, pad=1)


def _letters():
    d = Dictionary()
    for w in "abcdefg":
        d.add_symbol(w)
    return d


@pytest.mark.parametrize("arch", ["bpt_classifier", "segtree_classifier"])
def test_tree_leaves_are_the_sentence_words(arch):
    """With --no-bos-eos-tokens the tree is built over the words alone: its leaves (the encoder's
    token nodes) are exactly the sentence's tokens, and the root is the one the bare words give."""
    torch.manual_seed(0)
    d = _letters()
    model = _tiny_model(MODELS[arch], arch, d, "--no-bos-eos-tokens", "--sentence-readout", "root")
    words = [[5, 6, 7], [8, 9]]
    rows = torch.tensor([[d.bos(), 5, 6, 7, d.eos()], [d.bos(), 8, 9, d.eos(), d.pad()]])
    with torch.no_grad():
        got, out = model(rows)
        model.cfg.no_bos_eos_tokens = False  # the same weights, fed the bare words
        want = [model(torch.tensor([w]))[0] for w in words]
        _, with_specials = model(rows)
    leaves = out["src_tokens"][0]
    assert [row[row.ne(d.pad())].tolist() for row in leaves] == words
    assert out["encoder_out"][0].size(0) == 3  # token nodes of the longest sentence, no <s>/</s> among them
    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    assert with_specials["src_tokens"][0][:, 0].tolist() == [d.bos()] * 2  # without the option: <s> is a leaf


def test_words_only_refuses_what_needs_the_specials():
    d = _letters()
    with pytest.raises(ValueError, match="cls-max reads the <s>"):
        _tiny_model(BPTClassifierModel, "bpt_classifier", d, "--no-bos-eos-tokens", "--sentence-readout", "cls-max")
    model = _tiny_model(BPTClassifierModel, "bpt_classifier", d, "--no-bos-eos-tokens")
    with pytest.raises(ValueError, match="tagger"):
        model.register_classification_head("tags", num_classes=3, token_level=True)


@pytest.mark.parametrize("arch", ["bpt_classifier", "transformer_classifier"])
def test_embed_dropout_drops_the_embeddings_in_training_only(arch):
    """--embed-dropout is the only stochastic step of a model with every other rate 0: in float64, the
    training output equals the evaluation output computed from the embeddings it dropped; the
    dropped embeddings are the embedding layer's output, zeroed or scaled by 1/(1-p)."""
    torch.manual_seed(0)
    d = _letters()
    p = 0.4
    model = _tiny_model(MODELS[arch], arch, d, "--embed-dropout", str(p), "--attention-dropout", "0",
                        "--no-scale-embedding", "--no-token-positional-embeddings")
    assert _tiny_model(MODELS[arch], arch, d, "--dropout", "0.3").encoder.dropout_module.p == 0.3  # unset: --dropout
    model.register_classification_head("head", num_classes=3)
    model.double()
    rows = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 2]] * 8)
    seen = {}

    def keep(module, args, out):
        seen["in"], seen["out"] = args[0], out

    hook = model.encoder.dropout_module.register_forward_hook(keep)
    model.train()
    trained, _ = model(rows, classification_head_name="head")
    hook.remove()
    embedded, dropped = seen["in"], seen["out"]
    torch.testing.assert_close(embedded, model.encoder.embed_tokens(rows))
    zeroed = dropped.eq(0)
    torch.testing.assert_close(dropped, torch.where(zeroed, 0.0, embedded / (1 - p)))
    assert 0.25 < zeroed.double().mean().item() < 0.55
    model.eval()
    with torch.no_grad():
        plain, _ = model(rows, classification_head_name="head")
        hook = model.encoder.dropout_module.register_forward_hook(lambda module, args, out: dropped)
        replayed, _ = model(rows, classification_head_name="head")
        hook.remove()
    torch.testing.assert_close(trained, replayed, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(trained, plain)  # in training the embeddings were dropped; in evaluation never
    assert torch.equal(model.encoder.dropout_module(embedded), embedded)


@pytest.mark.slow
def test_bpt_classifier_as_the_original_cli(sentence_data, tmp_path):
    """fairseq-train with the original's settings (input dropout and its layer norm, weight decay,
    words-only tree):
    they reach the trained model, which learns and scores as the hub predicts."""
    save = _train(sentence_data, tmp_path / "ckpt", "--arch", "bpt_classifier", *SENTENCE_ARGS,
                  "--embed-dropout", "0.4", "--layernorm-dropped-embedding", "--weight-decay", "5e-5",
                  "--no-bos-eos-tokens", "--sentence-readout", "root", "--max-update", "60")
    hub = BPTClassifierModel.from_pretrained(str(save), "checkpoint_best.pt", str(sentence_data),
                                             user_dir=str(USER_DIR))
    hub.eval()
    cfg = hub.model.cfg
    assert (cfg.embed_dropout, cfg.layernorm_dropped_embedding, cfg.no_bos_eos_tokens) == (0.4, True, True)
    assert hub.model.encoder.dropout_module.p == 0.4 and hub.model.encoder.dropout_module.norm is not None
    state = torch.load(save / "checkpoint_best.pt", weights_only=False)
    assert state["cfg"]["optimizer"]["weight_decay"] == 5e-5
    accuracy = _accuracy(hub, sentence_data.parent / "raw")
    labels = (sentence_data.parent / "raw" / "test.label").read_text().split()
    assert accuracy > max(labels.count(x) for x in set(labels)) / len(labels)
    assert score_checkpoint(save / "checkpoint_best.pt", sentence_data)["accuracy"] == pytest.approx(100 * accuracy)


def test_layernorm_after_the_embedding_dropout():
    """--layernorm-dropped-embedding: norm(dropout(embedding)) in float64, the originals' order; in
    evaluation the plain norm of the embeddings."""
    d = _letters()
    model = _tiny_model(BPTClassifierModel, "bpt_classifier", d, "--embed-dropout", "0.4",
                        "--layernorm-dropped-embedding").double()
    module = model.encoder.dropout_module
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
        module.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    module.train()
    torch.manual_seed(1)
    got = module(x)
    torch.manual_seed(1)
    kept = torch.nn.functional.dropout(torch.ones_like(x), 0.4, training=True)  # the same draw: 0 or 1/(1-p)
    norm = lambda y: torch.nn.functional.layer_norm(y, (32,), module.norm.weight, module.norm.bias, 1e-5)  # noqa: E731
    torch.testing.assert_close(got, norm(x * kept), rtol=1e-12, atol=1e-12)
    module.eval()
    torch.testing.assert_close(module(x), norm(x), rtol=1e-12, atol=1e-12)
    assert _tiny_model(BPTClassifierModel, "bpt_classifier", d).encoder.dropout_module.norm is None  # default: none
    with pytest.raises(ValueError, match="--layernorm-embedding"):
        _tiny_model(BPTClassifierModel, "bpt_classifier", d, "--layernorm-dropped-embedding", "--layernorm-embedding")
