"""Scale distribution across layers: the alpha rule, the paper's worked example, explicit lists."""

import pytest

from fairseq_plugins.modules.multiscale.scale_distribution import (
    PAPER_CANDIDATES,
    PAPER_EXAMPLE_COUNTS,
    alpha_head_counts,
    expand_counts,
    layer_scales,
)
from fairseq_plugins.modules.multiscale.multiscale_attention import parse_scales


def test_alpha_rule_reproduces_the_papers_worked_example():
    assert alpha_head_counts(0.5, num_heads=10, num_layers=3, num_scales=5) == [
        list(counts) for counts in PAPER_EXAMPLE_COUNTS
    ]
    assert [list(c) for c in PAPER_EXAMPLE_COUNTS] == [[5, 2, 2, 1, 0], [4, 2, 2, 1, 1], [2, 2, 2, 2, 2]]


@pytest.mark.parametrize("alpha", [-1.0, -0.5, 0.0, 0.5, 1.0])
@pytest.mark.parametrize("heads,layers", [(4, 6), (8, 6), (10, 3), (16, 2), (1, 1)])
def test_counts_always_sum_to_the_head_count_and_the_top_layer_is_uniform(alpha, heads, layers):
    counts = alpha_head_counts(alpha, heads, layers, 5)
    assert len(counts) == layers
    assert all(sum(layer) == heads and min(layer) >= 0 for layer in counts)
    assert counts[-1] == alpha_head_counts(0.0, heads, 1, 5)[0]


def test_sign_of_alpha_moves_heads_between_small_and_large_scales():
    def mean_scale_index(layer):
        return sum(k * n for k, n in enumerate(layer)) / sum(layer)

    local = alpha_head_counts(1.0, 8, 6, 5)
    globl = alpha_head_counts(-1.0, 8, 6, 5)
    # positive alpha: bottom layers favour small scales, more so the lower they are
    assert mean_scale_index(local[0]) < mean_scale_index(local[2]) < mean_scale_index(local[-1])
    assert mean_scale_index(globl[0]) > mean_scale_index(globl[-1])


def test_layer_scales_from_alpha_preset_and_explicit_lists():
    by_alpha = layer_scales("", 10, 3, 0.5, PAPER_CANDIDATES)
    preset = layer_scales("paper-example", 10, 3, 0.0, "1,3")
    assert preset == by_alpha
    assert [str(s) for s in preset[0]] == ["1"] * 5 + ["3"] * 2 + ["N/16"] * 2 + ["N/8"]
    assert [str(s) for s in preset[2]] == ["1", "1", "3", "3", "N/16", "N/16", "N/8", "N/8", "N/4", "N/4"]

    explicit = layer_scales("1,3|N/4,all", 2, 2, 0.0, PAPER_CANDIDATES)
    assert [[str(s) for s in layer] for layer in explicit] == [["1", "3"], ["N/4", "all"]]
    shared = layer_scales("1,N/2", 2, 3, 0.0, PAPER_CANDIDATES)
    assert len(shared) == 3 and all([str(s) for s in layer] == ["1", "N/2"] for layer in shared)
    assert expand_counts([2, 0, 1], parse_scales("1,3,all")) == parse_scales("1,1,all")


@pytest.mark.parametrize(
    "spec,heads,layers,match",
    [
        ("1,3|1,3", 2, 3, "2 scale lists for 3 layers"),
        ("1,3,5", 2, 1, "3 scales for 2 heads"),
        ("1,4", 2, 1, "odd"),
        ("paper-example", 8, 3, "10 heads and 3 layers"),
    ],
)
def test_bad_specs_are_refused(spec, heads, layers, match):
    with pytest.raises(ValueError, match=match):
        layer_scales(spec, heads, layers, 0.5, PAPER_CANDIDATES)
