"""The tagger's linear-chain CRF against brute-force enumeration of every tag sequence, in float64."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from fairseq_plugins.modules.common.linear_crf import LinearChainCRF

TAGS = 3
LENGTHS = [4, 1, 3, 2, 0]  # one batch, right-padded to 4, with a row without words


def _crf_and_batch(seed=0):
    torch.manual_seed(seed)
    crf = LinearChainCRF(TAGS).double()
    with torch.no_grad():
        for p in crf.parameters():
            p.normal_()
    emissions = torch.randn(len(LENGTHS), max(LENGTHS), TAGS, dtype=torch.float64)
    mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    tags = torch.randint(TAGS, mask.shape).masked_fill(~mask, -100)
    return crf, emissions, mask, tags


def _path_score(crf, emissions, path):
    """The score of one row's tag sequence, written out term by term."""
    total = crf.start[path[0]] + crf.end[path[-1]]
    for t, tag in enumerate(path):
        total = total + emissions[t, tag]
        if t:
            total = total + crf.transitions[path[t - 1], tag]
    return total


def _enumerated(crf, emissions, n):
    """(scores of all TAGS ** n sequences of a row, the sequences)."""
    paths = list(itertools.product(range(TAGS), repeat=n))
    return torch.stack([_path_score(crf, emissions, p) for p in paths]), paths


def test_log_partition_score_and_nll_equal_enumeration():
    crf, emissions, mask, tags = _crf_and_batch()
    log_z, gold, nll = crf.log_partition(emissions, mask), crf.score(emissions, tags, mask), crf(emissions, tags, mask)
    for b, n in enumerate(LENGTHS):
        if n == 0:
            assert log_z[b] == gold[b] == nll[b] == 0
            continue
        scores, _ = _enumerated(crf, emissions[b], n)
        torch.testing.assert_close(log_z[b], torch.logsumexp(scores, 0))
        torch.testing.assert_close(gold[b], _path_score(crf, emissions[b], tags[b, :n].tolist()))
        torch.testing.assert_close(nll[b], -(gold[b] - torch.logsumexp(scores, 0)))
    # padding emissions change nothing
    noisy = emissions.masked_fill(~mask[..., None], 1e3)
    torch.testing.assert_close(crf(noisy, tags, mask), nll)


def test_viterbi_is_the_best_enumerated_sequence():
    crf, emissions, mask, _ = _crf_and_batch(1)
    path, score = crf.decode(emissions, mask)
    for b, n in enumerate(LENGTHS):
        assert path[b, n:].eq(-1).all()
        if n == 0:
            assert score[b] == 0
            continue
        scores, paths = _enumerated(crf, emissions[b], n)
        assert tuple(path[b, :n].tolist()) == paths[int(scores.argmax())]
        torch.testing.assert_close(score[b], scores.max())


def test_without_transitions_the_nll_is_the_per_word_cross_entropy():
    """Zero transitions, start and end: the CRF factorizes into a softmax per word."""
    _, emissions, mask, tags = _crf_and_batch(2)
    crf = LinearChainCRF(TAGS).double()
    per_word = F.cross_entropy(emissions.transpose(1, 2), tags, ignore_index=-100, reduction="none").sum(1)
    torch.testing.assert_close(crf(emissions, tags, mask), per_word)
    assert torch.equal(crf.decode(emissions, mask)[0], emissions.argmax(-1).masked_fill(~mask, -1))


def test_nll_gradients():
    crf, emissions, mask, tags = _crf_and_batch(3)
    emissions.requires_grad_(True)

    def nll(e, transitions, start, end):
        params = {"transitions": transitions, "start": start, "end": end}
        return torch.func.functional_call(crf, params, (e, tags, mask))

    params = [p.detach().clone().requires_grad_(True) for p in (crf.transitions, crf.start, crf.end)]
    assert torch.autograd.gradcheck(nll, (emissions, *params))


def test_half_parameters_sum_in_float32():
    """Under --fp16 the CRF's parameters are half and the criterion hands it float32 emissions."""
    crf, emissions, mask, tags = _crf_and_batch(4)
    reference = crf.float()(emissions.float(), tags, mask)
    half = crf.half()
    nll = half(emissions.float(), tags, mask)
    for out in (half.log_partition(emissions.float(), mask), half.score(emissions.float(), tags, mask),
                half.decode(emissions.float(), mask)[1]):
        assert out.dtype == torch.float32
    torch.testing.assert_close(nll, reference, atol=0.05, rtol=0.01)  # only the parameters were rounded
    nll.sum().backward()
    assert half.transitions.grad.dtype == torch.float16 and half.transitions.grad.abs().sum() > 0


def test_bad_masks_and_shapes_are_refused():
    crf, emissions, mask, tags = _crf_and_batch()
    with pytest.raises(ValueError, match="words first"):
        crf(emissions, tags, mask.flip(1))
    with pytest.raises(ValueError, match=r"\[B x T x 3\]"):
        crf.decode(emissions[..., :2], mask)
