"""TranSFormer Table 8: a row's model FLOPs counted in-process, against hand counts of tiny models,
and the table printed by fairseq-plugins-reproduce."""

import json

import pytest
import yaml

from fairseq_plugins.recipes import measure_flops, reproduce_table
from fairseq_plugins.recipes.config import ConfigError

D, FFN, HEADS, VOCAB, LETTERS = 16, 24, 2, 40, 3
TINY = {
    "encoder-layers": 1, "decoder-layers": 1, "encoder-embed-dim": D, "decoder-embed-dim": D,
    "encoder-ffn-embed-dim": FFN, "decoder-ffn-embed-dim": FFN, "encoder-attention-heads": HEADS,
    "decoder-attention-heads": HEADS, "share-all-embeddings": True,
}  # fmt: skip


def hand_count(src: int, tgt: int) -> dict:
    """2 FLOPs per multiply-add of every matrix product of a 1-layer transformer."""
    def attention(queries, keys):
        projections = 2 * queries * D * D * 2 + 2 * keys * D * D * 2  # q and out; k and v
        return projections + 2 * queries * keys * D * 2  # scores and the weighted sum, all heads
    encoder = attention(src, src) + 2 * src * D * FFN * 2
    decoder = attention(tgt, tgt) + attention(tgt, src) + 2 * tgt * D * FFN * 2 + 2 * tgt * D * VOCAB
    return {"model": encoder + decoder, "encoder": encoder, "decoder": decoder}


def _row(arch="transformer", **model):
    return {"name": "t/row", "arch": arch, "model": {**TINY, **model},
            "evaluate": {"source-length": 7, "target-length": 5, "letters-per-subword": LETTERS,
                         "dictionary-size": VOCAB}}


def test_a_tiny_transformer_counts_as_by_hand():
    cfg = _row()
    d = measure_flops.synthetic_dictionary(VOCAB, LETTERS)
    flops = measure_flops.count_flops(measure_flops.build_model(cfg, d), d, 7, 5)
    assert flops == hand_count(7, 5)


def test_the_backward_pass_is_counted_only_when_asked():
    cfg = _row()
    d = measure_flops.synthetic_dictionary(VOCAB, LETTERS)
    forward = measure_flops.count_flops(measure_flops.build_model(cfg, d), d, 7, 5)["model"]
    both = measure_flops.count_flops(measure_flops.build_model(cfg, d), d, 7, 5, backward=True)["model"]
    assert 2.5 * forward < both < 3.5 * forward  # backward: about twice the forward's products


def test_the_fast_branch_reads_letters_and_a_word_end_per_subword():
    d = measure_flops.synthetic_dictionary(VOCAB, LETTERS)
    assert len(d) == VOCAB and len(set(d.symbols)) == VOCAB
    assert all(len(s) == LETTERS for s in d.symbols[d.nspecial:])
    model = measure_flops.build_model(_row("transformer_slowfast", **{"fast-embed-dim": 8}), d)
    import torch

    src = torch.tensor([list(range(d.nspecial, d.nspecial + 6)) + [d.eos()]])
    fast = model.encoder.fast_branch_input(src)
    assert (~fast.padding_mask).sum() == 6 * (LETTERS + 1) + 1  # + the end-of-sentence symbol


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="dictionary-size"):
        measure_flops.settings({**_row(), "evaluate": {"source-length": 7}})
    with pytest.raises(ConfigError, match="part"):
        measure_flops.settings({**_row(), "evaluate": {**_row()["evaluate"], "part": "head"}})
    with pytest.raises(ConfigError, match="does not fit"):
        measure_flops.synthetic_dictionary(10**6, 2)


def test_reproduce_prints_a_measured_table(tmp_path, capsys):
    table = {
        "table": "tiny-flops", "title": "Tiny FLOPs", "paper": "slowfast", "metric": "gflops", "measure": "flops",
        "defaults": {"data": "none", "arch": "transformer", "gpus": 1, "average_last": 0, "model": TINY,
                     "evaluate": {"source-length": 7, "target-length": 5, "letters-per-subword": LETTERS,
                                  "dictionary-size": VOCAB, "part": "encoder"}},
        "sources": {"data": "ours: t", "arch": "ours: t", "gpus": "ours: t", "average_last": "ours: t",
                    **{f"model.{k}": "ours: t" for k in TINY},
                    **{f"evaluate.{k}": "ours: t" for k in ("source-length", "target-length",
                                                             "letters-per-subword", "dictionary-size", "part")}},
        "rows": [{"id": "tiny", "row": "Tiny", "reported": {"gflops": 1.0}},
                 {"row": "Not built", "reported": {"BLEU": 2.0}, "why": "because"}],
    }  # fmt: skip
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(table))
    text = reproduce_table.main([str(path), "--results-dir", str(tmp_path / "results")])
    result = json.loads((tmp_path / "results" / "tiny-flops" / "tiny.json").read_text())
    assert result["gflops"] * 1e9 == hand_count(7, 5)["encoder"]
    assert result["model_gflops"] * 1e9 == hand_count(7, 5)["model"]
    assert f"| Tiny | 1.00 | {result['gflops']:.2f} | encoder, forward of one pair" in text
    assert "| Not built | 2.00 | - | because |" in text
    assert "training runs" not in capsys.readouterr().out


def test_table8_dry_run_measures_every_row_and_trains_nothing(tmp_path, capsys):
    reproduce_table.main(["slowfast-table8", "--dry-run", "--results-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("slowfast-table8: 4 rows measured in-process (flops), nothing trained")
    for row in ("baseline-base", "transformer-base", "baseline-big", "transformer-big"):
        assert f"# -> {tmp_path}/slowfast-table8/{row}.json" in out
    assert "fairseq-train" not in out and "--no-fast-branch --no-slow-word-graph on 30 -> 30 subwords" in out
    assert not (tmp_path / "slowfast-table8").exists()
