"""The span-row floor of ``scripts/profile_split.py``: the papers' extra GEMM work, from the model's shapes."""

import pytest
import torch

from fairseq_plugins.check_gpu.model_update import build_model
from fairseq_plugins.graphs.binary_partition import tree_level_sizes
from scripts.profile_split import span_floor

SIZE = dict(encoder_embed_dim=8, encoder_ffn_embed_dim=24, encoder_attention_heads=2, encoder_layers=2)


def _dictionary():
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(10):
        d.add_symbol(f"w{i}")
    return d


def _batch(pad, src_lengths, tgt_lengths):
    def tokens(lengths):
        out = torch.full((len(lengths), max(lengths)), pad)
        for row, n in enumerate(lengths):
            out[row, :n] = 5
        return out

    return dict(src_tokens=tokens(src_lengths), src_lengths=torch.tensor(src_lengths),
                target=tokens(tgt_lengths))


@pytest.mark.parametrize("sides", ["both", "encoder"])
def test_span_floor_counts_the_span_rows_gemm_flops(sides):
    d = _dictionary()
    model = build_model("bpt_transformer", dict(graph_sides=sides), SIZE, {"en": d, "de": d})
    batch = _batch(d.pad(), [5, 3], [4, 4])
    baseline = {"ffn": 2.0, "total": 10.0, "model body": 6.0}
    floor = span_floor(baseline, {"total": 16.0, "model body": 11.0}, model, batch, d.pad())
    # span rows (no padding): 5 tokens -> 5+3+2+1 nodes, 3 -> 3+2+1, 4 -> 4+2+1
    spans = {"encoder": (11 - 5) + (6 - 3), "decoder": 2 * (7 - 4)}
    dim, ffn, layers = 8, 24, 2
    per_row = layers * 3 * dim * dim + (layers - 1) * (dim * dim + 2 * dim * ffn)  # q/k/v; out_proj + FFN but last
    extra = sum(3 * 2 * rows * per_row for side, rows in spans.items() if sides in (side, "both"))
    ffn_flops = 3 * 2 * (2 * 5 + 2 * 4) * 2 * dim * ffn * layers  # the transformer's FFN, padded tokens
    seconds = extra * 2.0 / ffn_flops
    assert floor["span_seconds"] == pytest.approx(seconds)
    assert floor["floor_ratio"] == pytest.approx((10.0 + seconds) / 10.0)
    assert floor["above_floor"] == pytest.approx(16.0 / (10.0 + seconds))
    assert floor["body_above_floor_seconds"] == pytest.approx(11.0 - 6.0 - seconds)
    assert sum(tree_level_sizes(5)) == 11


def test_span_floor_is_none_without_span_nodes():
    d = _dictionary()
    model = build_model("transformer", {}, SIZE, {"en": d, "de": d})
    batch = _batch(d.pad(), [3], [3])
    assert span_floor({"ffn": 1.0, "total": 2.0, "model body": 1.5}, {"total": 2.0, "model body": 1.5},
                      model, batch, d.pad()) is None
