"""Prompting a language model as a user does: ``fairseq-interactive --task language_modeling`` and
the hub (``from_pretrained`` + ``sample``), on the tiny ``bpt_lm`` that tests/tasks/lm/test_lm_cli.py
also tests (tests/lm_fixture.py). A prompt goes in, the prompt and its continuation come out; greedy
continuations, decoded incrementally by fairseq's generator, equal greedy decoding that
recomputes the whole prefix with the full model at every step, and so do the log-probabilities
the generator reports for every token (a tiny model's greedy text alone is mostly spaces)."""

import math
import re

import pytest
import torch

from tests.cli import USER_DIR, run_cli

PROMPT = "84 104 101 32 99 105 116 121 32 111 102 32"  # "The city of " as enwik8 tokens (bytes)
LENGTH = 40  # prompt and continuation, in tokens: --min-len and --max-len-b both, so no early </s>
SHORT = " ".join(PROMPT.split()[:4])  # "The "
GREEDY = ["--beam", "1", "--min-len", str(LENGTH), "--max-len-b", str(LENGTH)]


@pytest.fixture(scope="module")
def bpt_lm_checkpoint(enwik8_bin, tiny_lm):
    return enwik8_bin, tiny_lm("bpt_lm")


def greedy_by_recomputation(model, dictionary, prompt: str, length: int):
    """The generator's greedy search without its incremental state: the model scores the whole
    prefix ([</s>] + tokens, as language_modeling conditions on it) at every step; padding is
    never chosen, the end of line not before ``length`` tokens."""
    tokens = [dictionary.index(t) for t in prompt.split()]
    while len(tokens) < length:
        prefix = torch.tensor([[dictionary.eos(), *tokens]])
        with torch.no_grad():
            logits = model(prefix)[0][0, -1]
        logits[dictionary.pad()] = logits[dictionary.eos()] = float("-inf")
        tokens.append(int(logits.argmax()))
    return tokens


def log_probs_by_recomputation(model, dictionary, tokens):
    """Natural-log probability of each token and of the closing </s>, from one full forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([[dictionary.eos(), *tokens]]))[0][0].double()
    targets = torch.tensor([*tokens, dictionary.eos()])
    return logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1).tolist()


@pytest.fixture(scope="module")
def reference(bpt_lm_checkpoint):
    from fairseq import checkpoint_utils

    data, ckpt = bpt_lm_checkpoint
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpt / "checkpoint_last.pt")], arg_overrides={"data": str(data)})
    models[0].eval()
    dictionary = task.source_dictionary
    tokens = greedy_by_recomputation(models[0], dictionary, PROMPT, LENGTH)
    return " ".join(dictionary[t] for t in tokens), log_probs_by_recomputation(models[0], dictionary, tokens)


@pytest.mark.slow
def test_fairseq_interactive_continues_a_prompt(bpt_lm_checkpoint, reference):
    data, ckpt = bpt_lm_checkpoint
    out = run_cli("fairseq-interactive", data, "--user-dir", USER_DIR, "--task", "language_modeling",
                  "--path", ckpt / "checkpoint_last.pt", "--tokens-per-sample", "64", *GREEDY, "--cpu",
                  input=f"{PROMPT}\n{SHORT}\n").stdout
    hypotheses = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", out, re.M))
    scores = dict(re.findall(r"^P-(\d+)\t(.*)$", out, re.M))
    assert set(hypotheses) == {"0", "1"}
    assert hypotheses["0"].startswith(PROMPT + " ") and len(hypotheses["0"].split()) == LENGTH
    text, log_probs = reference
    assert hypotheses["0"] == text
    base2 = [float(x) for x in scores["0"].split()]  # fairseq-interactive prints base 2, 4 decimals
    assert base2 == pytest.approx([lp / math.log(2) for lp in log_probs], abs=1e-3)
    assert hypotheses["1"].startswith(SHORT + " ") and len(hypotheses["1"].split()) == LENGTH


@pytest.mark.slow
def test_hub_from_pretrained_samples_a_continuation(bpt_lm_checkpoint, reference):
    from fairseq_plugins.models.bpt_lm import BPTLanguageModel

    data, ckpt = bpt_lm_checkpoint
    hub = BPTLanguageModel.from_pretrained(str(ckpt), "checkpoint_last.pt", str(data), user_dir=str(USER_DIR))
    text, log_probs = reference
    assert hub.sample(PROMPT, beam=1, min_len=LENGTH, max_len_b=LENGTH) == text
    hypothesis = hub.generate(hub.encode(PROMPT), beam=1, min_len=LENGTH, max_len_b=LENGTH)[0]
    assert hypothesis["positional_scores"].tolist() == pytest.approx(log_probs, abs=1e-5)
    torch.manual_seed(1)
    sampled = hub.sample([PROMPT, PROMPT], sampling=True, sampling_topk=5, min_len=LENGTH, max_len_b=LENGTH)
    assert all(s.startswith(PROMPT + " ") and len(s.split()) == LENGTH for s in sampled)
    assert all(0 <= int(t) < 256 for s in sampled for t in s.split())  # bytes, as the dictionary holds
