"""A character language model samples text with line breaks, end to end: a user's text prepared by
``fairseq-plugins-prepare-data text``, a tiny ``bpt_lm`` trained on it by fairseq-train, samples
from ``fairseq-interactive --bpe code_points`` and from the hub (``bpe="code_points"``), decoded
back to text. The text is short lines, so the model favours a newline after each one: a sample
of N characters holds several, and generation does not stop at the first (the newline is a
character, not fairseq's end of sequence)."""

import re

import pytest

from fairseq_plugins.recipes import prepare_data
from tests.cli import USER_DIR, run_cli
from tests.lm_fixture import train_lm

TEXT = "".join(f"line {i % 7}\n" for i in range(3000))  # 21,000 characters, 7 to a line
PROMPT = "line 3"
N = 50  # characters sampled after the prompt


@pytest.fixture(scope="module")
def text_lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_lm")
    (root / "lines.txt").write_text(TEXT, encoding="utf-8")
    data = prepare_data.main(["text", "--raw-dir", str(root / "lines.txt"), "--out", str(root / "data-bin"),
                              "--heldout-chars", "500"])
    return data, train_lm(data, root / "ckpt", "bpt_lm", updates=40, lr=0.01)


def interactive(data, ckpt, *flags):
    """fairseq-interactive on PROMPT: the hypothesis's tokens (H-) and its decoded text (D-)."""
    out = run_cli("fairseq-interactive", data, "--user-dir", USER_DIR, "--task", "language_modeling",
                  "--path", ckpt / "checkpoint_last.pt", "--tokens-per-sample", "64", "--bpe", "code_points",
                  "--sampling", "--sampling-topk", "3", "--beam", "1", "--seed", "1", "--cpu", *flags,
                  input=PROMPT + "\n").stdout
    tokens = re.search(r"^H-0\t\S+\t(.*)$", out, re.M).group(1).split()
    text = re.search(r"^D-0\t\S+\t(.*?)\nP-0\t", out, re.M | re.S).group(1)
    return tokens, text


@pytest.mark.slow
def test_fairseq_interactive_samples_n_characters_with_line_breaks(text_lm):
    data, ckpt = text_lm
    length = str(len(PROMPT) + N)
    tokens, text = interactive(data, ckpt, "--min-len", length, "--max-len-b", length)
    assert len(tokens) == len(text) == len(PROMPT) + N and text.startswith(PROMPT)
    assert text.count("\n") >= N // 7 - 1  # a line break after about every 7 characters
    assert tokens[len(PROMPT)] == "10"  # "line 3" is followed by its newline, the symbol 10


@pytest.mark.slow
def test_generation_goes_past_the_first_line_break_without_min_len(text_lm):
    data, ckpt = text_lm
    _, text = interactive(data, ckpt, "--max-len-b", str(len(PROMPT) + N))
    assert len(text) == len(PROMPT) + N and text.count("\n") > 1


@pytest.mark.slow
def test_hub_sample_returns_text_with_line_breaks(text_lm):
    import torch

    from fairseq_plugins.models.bpt_lm import BPTLanguageModel

    data, ckpt = text_lm
    hub = BPTLanguageModel.from_pretrained(str(ckpt), "checkpoint_last.pt", str(data), user_dir=str(USER_DIR),
                                           bpe="code_points")
    torch.manual_seed(1)
    prompts = [PROMPT, "line 5\nline"]  # a prompt may hold line breaks
    samples = hub.sample(prompts, sampling=True, sampling_topk=3, max_len_b=len(PROMPT) + N)
    for prompt, sample in zip(prompts, samples):
        assert sample.startswith(prompt) and len(sample) > len(prompt) and sample.count("\n") > 2


@pytest.mark.slow
def test_hub_sample_of_a_byte_model_is_text(enwik8_bin, tiny_lm):
    """The enwik8 fixture's tiny bpt_lm, through bpe="byte_values": more characters than the prompt."""
    import torch

    from fairseq_plugins.models.bpt_lm import BPTLanguageModel

    hub = BPTLanguageModel.from_pretrained(str(tiny_lm("bpt_lm")), "checkpoint_last.pt", str(enwik8_bin),
                                           user_dir=str(USER_DIR), bpe="byte_values")
    torch.manual_seed(1)
    sample = hub.sample("The city ", sampling=True, sampling_topk=10, max_len_b=40)
    assert sample.startswith("The city ") and len(sample) > len("The city ")
    assert hub.encode("é\n").tolist()[:-1] == [hub.task.source_dictionary.index(b) for b in ("195", "169", "10")]
