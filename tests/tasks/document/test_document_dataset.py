"""DocumentPairDataset: samples, batches and their agreement with fairseq's sentence-level ones."""

import numpy as np
import pytest
import torch

pytest.importorskip("fairseq")
from fairseq.data import Dictionary, LanguagePairDataset  # noqa: E402

from fairseq_plugins.data.document_pair_dataset import DocumentPairDataset  # noqa: E402


class Sentences(torch.utils.data.Dataset):
    """In-memory stand-in for a binarized split: items end with </s>, `sizes` like fairseq's."""

    def __init__(self, items):
        self.items = [torch.tensor(x, dtype=torch.long) for x in items]
        self.sizes = np.array([len(x) for x in self.items])

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def toy_corpus():
    d = Dictionary()
    for w in "abcdefghij":
        d.add_symbol(w)
    eos = d.eos()
    words = [[4, 5], [6], [7, 8, 9], [10], [11, 12], [13]]
    src = Sentences([w + [eos] for w in words])
    tgt = Sentences([[x + 1 for x in w] + [eos] for w in words])
    docids = ["A", "A", "A", "B", "B", "B"]
    return d, src, tgt, docids


def test_samples_join_whole_preceding_sentences_of_the_document():
    d, src, tgt, docids = toy_corpus()
    sep, eos = d.bos(), d.eos()
    ds = DocumentPairDataset(src, tgt, d, d, docids, max_context_tokens=5)
    # sentence 2 (A): 1 + 2 preceding sentences of 3 + 2 tokens fit in 5
    item = ds[2]
    assert item["source"].tolist() == [4, 5, sep, 6, sep, 7, 8, 9, eos]
    assert item["target_context"].tolist() == [5, 6, sep, 7, sep]
    assert item["target"].tolist() == [8, 9, 10, eos]
    # sentence 3 starts document B: no context although A's sentences would fit
    assert ds[3]["source"].tolist() == [10, eos] and len(ds[3]["target_context"]) == 0
    # sentence 4: the only earlier sentence of B (2 tokens) is its context
    assert ds[4]["source"].tolist() == [10, sep, 11, 12, eos]
    assert ds.src_sizes.tolist() == [3, 5, 9, 2, 5, 7] and ds.tgt_sizes.tolist() == ds.src_sizes.tolist()
    assert DocumentPairDataset(src, tgt, d, d, docids, max_context_tokens=4)[2]["source"].tolist() == [
        6, sep, 7, 8, 9, eos,
    ]


def test_batch_puts_loss_on_the_current_sentence_only():
    d, src, tgt, docids = toy_corpus()
    sep, eos, pad = d.bos(), d.eos(), d.pad()
    ds = DocumentPairDataset(src, tgt, d, d, docids, max_context_tokens=5)
    batch = ds.collater([ds[2], ds[3]])
    assert batch["net_input"]["prev_output_tokens"].tolist() == [
        [eos, 5, 6, sep, 7, sep, 8, 9, 10],
        [eos, 11, pad, pad, pad, pad, pad, pad, pad],
    ]
    assert batch["target"].tolist() == [
        [pad, pad, pad, pad, pad, 8, 9, 10, eos],
        [11, eos, pad, pad, pad, pad, pad, pad, pad],
    ]
    assert batch["target_context"].tolist() == [[5, 6, sep, 7, sep], [pad] * 5]
    assert batch["ntokens"] == 6 and batch["nsentences"] == 2
    assert batch["net_input"]["src_tokens"][1].tolist() == [pad] * 7 + [10, eos]  # left padding


def test_without_context_the_batch_is_fairseqs_sentence_level_batch():
    d, src, tgt, docids = toy_corpus()
    ours = DocumentPairDataset(src, tgt, d, d, docids, max_context_tokens=0)
    stock = LanguagePairDataset(src, src.sizes, d, tgt, tgt.sizes, d)
    indices = [0, 2, 3, 5]
    a = ours.collater([ours[i] for i in indices])
    b = stock.collater([stock[i] for i in indices])
    order = b["id"].argsort()  # fairseq sorts the batch by source length
    for key in ("src_tokens", "src_lengths", "prev_output_tokens"):
        assert torch.equal(a["net_input"][key], b["net_input"][key][order]), key
    assert torch.equal(a["target"], b["target"][order]) and a["ntokens"] == b["ntokens"]


def test_mismatched_sides_are_rejected():
    d, src, tgt, docids = toy_corpus()
    with pytest.raises(ValueError, match="target sentences"):
        DocumentPairDataset(src, Sentences([[4, 2]]), d, d, docids, 5)
    with pytest.raises(ValueError, match="document ids"):
        DocumentPairDataset(src, tgt, d, d, docids[:-1], 5)


@pytest.mark.parametrize("config, samples_per_batch", [
    ("bpt-table6:bpt-k4-l0", 128), ("bpt-table6:bpt-k4-l32", 64), ("bpt-table6:transformer-l64", 32),
    ("bpt-table6:transformer-aligned-l128", 16), ("bpt-table6:bpt-k8-l128", 16), ("bpt-table5:bpt-k4-l32", 64),
])
def test_table_configs_batch_the_originals_chunk_samples(config, samples_per_batch):
    """The original's iwslt-*-{32,64,128}.yml: 64, 32, 16 chunk samples per batch; at l = 0 the
    paper's 128 sentences (Table 10). A sample counts its whole context window, so a token budget
    (--max-tokens) would hold a varying number: the configs count samples (--batch-size)."""
    from fairseq_plugins.recipes.config import load_config, train_options

    cfg = load_config(config)
    assert cfg["task"]["document-samples"] == "chunks"
    train = train_options(cfg, world_size=cfg["gpus"])
    d = Dictionary()
    for w in range(200):
        d.add_symbol(f"w{w}")
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 40, size=3600)  # IWSLT-like sentences, 120-sentence talks
    src = Sentences([list(rng.integers(d.nspecial, len(d), size=n)) + [d.eos()] for n in lengths])
    tgt = Sentences([list(rng.integers(d.nspecial, len(d), size=n)) + [d.eos()] for n in lengths])
    docids = [str(i // 120) for i in range(len(lengths))]
    ds = DocumentPairDataset(src, tgt, d, d, docids, max_context_tokens=cfg["task"]["context-tokens"],
                             samples=cfg["task"]["document-samples"])
    batches = ds.batch_by_size(ds.ordered_indices(), train.get("max-tokens"), train.get("batch-size"))
    sizes = sorted(len(b) for b in batches)
    assert sizes[1:] == [samples_per_batch] * (len(sizes) - 1) and sizes[0] == len(ds) % samples_per_batch
