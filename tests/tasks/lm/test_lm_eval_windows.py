"""The BPT language-model rows evaluate as the original code does: windows of eval_length whose
second half is scored, so every scored character has at least l/2 of context (l the training
context); through fairseq-eval-lm's --context-window. Checked on the windows fairseq builds:
every token of the split is scored exactly once, each after at least --context-window tokens
(all but the first block of the split)."""

import numpy as np
import pytest
import torch

pytest.importorskip("fairseq")
from fairseq.data import Dictionary, LMContextWindowDataset, MonolingualDataset, TokenBlockDataset  # noqa: E402

from fairseq_plugins.recipes.config import load_tables  # noqa: E402

BPT_LM_TABLES = ("bpt-table3", "bpt-table4", "bpt-figure5")
ROWS = [c for t in BPT_LM_TABLES for c in load_tables()[t]["configs"]]


@pytest.mark.parametrize("cfg", ROWS, ids=[c["name"] for c in ROWS])
def test_every_bpt_lm_row_scores_with_at_least_half_its_context(cfg):
    trained = cfg["task"]["tokens-per-sample"]
    window, context = cfg["evaluate"]["tokens-per-sample"], cfg["evaluate"].get("context-window", 0)
    assert 2 * context >= trained, f"{cfg['name']}: {context} tokens of context for l = {trained}"
    assert window - context >= 1


def scored_contexts(stream_length: int, window: int, context: int, batch: int = 3):
    """(position in the split, tokens before it in its window) of every scored token, as fairseq-eval-lm
    builds its batches: blocks of window - context new tokens, each after up to context earlier ones."""
    d = Dictionary()
    symbols = [d.add_symbol(str(i)) for i in range(50)]
    rng = np.random.default_rng(0)
    stream = torch.tensor(rng.choice(symbols, size=stream_length), dtype=torch.long)
    new = window - context  # fairseq-eval-lm takes the context window off tokens-per-sample
    blocks = TokenBlockDataset([stream], [stream_length], block_size=new, pad=d.pad(), eos=d.eos(),
                               break_mode="none", include_targets=True)
    dataset = LMContextWindowDataset(MonolingualDataset(blocks, blocks.sizes, d, d, add_eos_for_other_targets=False,
                                                        shuffle=False, targets=["future"]),
                                     tokens_per_sample=new, context_window=context, pad_idx=d.pad())
    out, offset = [], 0
    for start in range(0, len(dataset), batch):
        sample = dataset.collater([dataset[i] for i in range(start, min(start + batch, len(dataset)))])
        for target, first in zip(sample["target"], sample["start_indices"]):
            positions = target.ne(d.pad()).nonzero().view(-1).tolist()
            assert positions[0] == first and len(positions) <= new
            out += [(offset + j, p) for j, p in enumerate(positions)]
            offset += len(positions)
    return out


@pytest.mark.parametrize("window,context", [(16, 8), (24, 12), (8, 4), (9, 4)])
def test_the_windows_score_every_token_once_after_the_context(window, context):
    length = 101  # not a multiple of the block: the last block is short
    scored = scored_contexts(length, window, context)
    assert [position for position, _ in scored] == list(range(length))  # every token once, in order
    first_block = window - context
    assert all(before >= context for position, before in scored if position >= first_block)
    assert all(before == position for position, before in scored if position < first_block)
