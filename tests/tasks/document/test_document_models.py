"""Document-level models: information flow inside a sample (context + current sentence).

Checked on tiny random models built through the real fairseq option parser and task."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("fairseq")
from fairseq import options, tasks  # noqa: E402

# registered explicitly: fairseq's --user-dir import skips the package once a test imported it
import fairseq_plugins.models.bpt_document  # noqa: E402,F401
import fairseq_plugins.models.transformer_document  # noqa: E402,F401
import fairseq_plugins.tasks.document_translation  # noqa: E402,F401

from tests.cli import TINY_MODEL_ARGS, USER_DIR  # noqa: E402

ARCHS = ["transformer_document", "bpt_document"]
VOCAB = 30


def build(tmp_path: Path, arch: str, extra=()):
    for lang in ("en", "de"):
        (tmp_path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB)))
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(tmp_path), "--user-dir", str(USER_DIR), "--task", "document_translation",
        "-s", "en", "-t", "de", "--arch", arch, *TINY_MODEL_ARGS, "--dropout", "0", *extra,
    ])  # fmt: skip
    task = tasks.setup_task(args)
    torch.manual_seed(0)
    model = task.build_model(args).eval()
    return task, model


def sample(task, src_sentences, tgt_sentences):
    """One document-level sample (context sentences then the current one) as tensors."""
    d = task.source_dictionary
    sep, eos = d.bos(), d.eos()

    def join(sentences):
        ids = []
        for words in sentences[:-1]:
            ids += [d.index(f"w{w}") for w in words] + [sep]
        return ids + [d.index(f"w{w}") for w in sentences[-1]] + [eos]

    src = torch.tensor([join(src_sentences)])
    tgt = join(tgt_sentences)
    prev = torch.tensor([[eos] + tgt[:-1]])
    return src, prev


@pytest.mark.parametrize("arch", ARCHS)
def test_cross_attention_stays_on_the_aligned_sentence(tmp_path, arch):
    task, model = build(tmp_path, arch)
    src, prev = sample(task, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [[1, 2], [3, 4, 5], [6, 7]])
    _, extra = model(src, torch.tensor([src.size(1)]), prev)
    attn = extra["attn"][0][0]  # T x S, averaged over heads, last layer
    src_sentence = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    tgt_sentence = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    for t, k in enumerate(tgt_sentence):
        outside = [s for s, j in enumerate(src_sentence) if j != k]
        assert attn[t, outside].abs().max() == 0
        assert torch.allclose(attn[t].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("arch", ARCHS)
def test_decoder_is_causal_within_the_sample(tmp_path, arch):
    task, model = build(tmp_path, arch)
    src, prev = sample(task, [[1, 2, 3], [4, 5], [6, 7, 8]], [[1, 2], [3, 4, 5], [6, 7, 9]])
    lengths = torch.tensor([src.size(1)])
    reference, _ = model(src, lengths, prev)
    sep = task.target_dictionary.bos()
    for t in range(1, prev.size(1)):
        for replacement in (task.target_dictionary.index("w20"), sep):  # a word, or a new sentence
            if replacement == prev[0, t]:
                continue
            changed = prev.clone()
            changed[0, t] = replacement
            out, _ = model(src, lengths, changed)
            assert torch.allclose(out[0, :t], reference[0, :t], atol=1e-6), (t, replacement)
            assert not torch.allclose(out[0, t:], reference[0, t:], atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_decoding_matches_the_full_forward(tmp_path, arch):
    task, model = build(tmp_path, arch)
    src, prev = sample(task, [[1, 2], [4, 5, 6], [7, 8]], [[1, 2, 3], [3, 4], [6, 7, 9]])
    encoder_out = model.encoder(src, torch.tensor([src.size(1)]))
    full, _ = model.decoder(prev, encoder_out)
    state = {}
    steps = [model.decoder(prev[:, : t + 1], encoder_out, incremental_state=state)[0]
             for t in range(prev.size(1))]  # fmt: skip
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
