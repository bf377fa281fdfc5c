"""The figure scripts at tiny size: SegTree Figure 2 (peak memory), Multi-Scale Figure 2
(mirrored summation) and Figure 4 (test time per batch); their cores are the package's
(``fairseq_plugins.recipes.figures``), whose tables tests/recipes/test_figure_tables.py runs."""

import json

import pytest
import torch

pytest.importorskip("fairseq")
pytest.importorskip("matplotlib")

from scripts import benchmark_multiscale_speed, benchmark_segtree_memory  # noqa: E402
from scripts import mirrored_summation as mirrored_summation_script  # noqa: E402
from fairseq_plugins.modules.multiscale.multiscale_attention import parse_scales  # noqa: E402
from fairseq_plugins.recipes.figures import mirrored_summation, multiscale_speed, segtree_memory  # noqa: E402

TINY = {"layers": 1, "vocab": 40, "dim": 16, "ffn": 32, "batch": 2, "heads": 2}


def test_cpu_peak_is_the_most_live_memory_of_a_hand_counted_step():
    """(x @ w).relu() then backward, fp32: the forward holds x @ w and its relu (2 x 100 x 300
    bytes / 4), then frees x @ w; the backward frees the relu's output once the relu's gradient
    (100 x 300) is computed and peaks holding that gradient, the loss and its seed gradient (a
    scalar each) and the gradients of w (200 x 300) and x (100 x 200)."""
    x = torch.randn(100, 200, requires_grad=True)
    w = torch.randn(200, 300, requires_grad=True)

    def step():
        (x @ w).relu().sum().backward()

    peak = segtree_memory.peak_allocated_bytes(step, torch.device("cpu"))
    assert peak == 4 * (1 + 1 + 100 * 300 + 200 * 300 + 100 * 200)


def test_segtree_memory_rows_and_outputs(tmp_path, monkeypatch):
    monkeypatch.setitem(segtree_memory.SETTINGS, 1, TINY)
    rows = benchmark_segtree_memory.main(["--settings", "1", "--lengths", "8", "32", "--device", "cpu",
                                          "--out", str(tmp_path / "mem")])
    assert [(r["length"], r["model"]) for r in rows] == [
        (n, m) for n in (8, 32) for m in ("Transformer", "SegTree-Transformer")]
    for n in (8, 32):
        at_n = {r["model"]: r for r in rows if r["length"] == n}
        assert at_n["Transformer"]["ratio"] == 1.0
        # the same sizes (SegTree adds only its relative level embeddings): the shared embedding dominates
        assert at_n["Transformer"]["parameter_bytes"] > TINY["vocab"] * TINY["dim"] * 4
        assert 1 < at_n["SegTree-Transformer"]["parameter_bytes"] / at_n["Transformer"]["parameter_bytes"] < 1.1
    by = {(r["model"], r["length"]): r["peak_step_bytes"] for r in rows}
    # the logits alone (2 x 32 x 40 fp32) are live at the peak; more tokens, more memory
    assert by[("Transformer", 32)] > by[("Transformer", 8)] > 0 and by[("Transformer", 32)] >= 2 * 32 * 40 * 4
    assert json.loads((tmp_path / "mem.json").read_text())["rows"] == rows
    assert "CPU" in (tmp_path / "mem.md").read_text() and (tmp_path / "mem.png").stat().st_size > 0


def test_mirrored_summation_target_against_a_loop():
    a, target = mirrored_summation.mirrored_summation(3, 7, 4, 5, torch.Generator().manual_seed(0))
    assert a.shape == (3, 7, 4) and 0 <= a.min() and a.max() <= 1
    expected = torch.zeros(3, 4, dtype=torch.float64)
    for i in range(1, 6):  # sum_{i=1..K} a_i * a_{N-i+1}, 1-based
        expected += a[:, i - 1].double() * a[:, 7 - i].double()
    torch.testing.assert_close(target.double(), expected)
    with pytest.raises(ValueError, match="K must be in 1..7"):
        mirrored_summation.mirrored_summation(1, 7, 4, 8, torch.Generator())


def test_mirrored_summation_models_are_the_papers_variants():
    def layers(name):
        encoder = mirrored_summation.Regressor(name, 20, 0.0, 1.0).encoder
        return [tuple(layer.self_attn.scales) for layer in encoder.layers]

    three = tuple(parse_scales(",".join(["3"] * 10)))
    assert layers("MS-Trans-Hier-S") == [three] * 2
    assert layers("MS-Trans-deepHier-S") == [three] * 6
    assert layers("MS-Trans-Flex") == [tuple(parse_scales("3,3,N/16,N/16,N/8,N/8,N/4,N/4,N/2,N/2"))] * 2
    transformer = mirrored_summation.Regressor("Transformer", 20, 0.0, 1.0).encoder.layers
    assert len(transformer) == 2 and transformer[0].self_attn.num_heads == 10
    assert not hasattr(transformer[0].self_attn, "scales")  # fairseq's full attention


def test_mirrored_summation_tiny_run(tmp_path):
    rows = mirrored_summation_script.main(["--ks", "2", "--length", "8", "--dim", "10", "--steps", "2", "--batch", "4",
                                    "--test-samples", "16", "--out", str(tmp_path / "ms")])
    assert [r["model"] for r in rows] == list(mirrored_summation.MODELS)
    assert all(r["k"] == 2 and r["test_mse"] > 0 for r in rows)
    assert json.loads((tmp_path / "ms.json").read_text())["rows"] == rows
    assert (tmp_path / "ms.png").stat().st_size > 0


def test_mirrored_summation_bad_k_is_one_line(capsys):
    with pytest.raises(SystemExit):
        mirrored_summation_script.main(["--ks", "101"])
    assert "K must lie in 1..N (100), got [101]" in capsys.readouterr().err


def test_multiscale_speed_tiny_run(tmp_path):
    rows = benchmark_multiscale_speed.main(["--lengths", "SHORT=4", "LONG=12", "--repeats", "1", "--device", "cpu",
                                            "--out", str(tmp_path / "speed")])
    assert [(r["dataset"], r["model"]) for r in rows] == [
        (d, m) for d in ("SHORT", "LONG") for m in ("MS-Trans", "Transformer", "BiLSTM")]
    assert all(r["seconds"] > 0 for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["model"] == "Transformer")
    assert (tmp_path / "speed.png").stat().st_size > 0
    assert "| LONG | 12 | MS-Trans |" in (tmp_path / "speed.md").read_text()


def test_multiscale_speed_models_are_table3s():
    models = multiscale_speed.build_models(torch.device("cpu"))
    ms = models["MS-Trans"].__defaults__[0]
    assert [len(layer.self_attn.scales) for layer in ms.encoder.layers] == [10, 10, 10]
    assert ms.encoder.layers[0].drop_ffn  # the paper's layer without FFN
    logits = models["BiLSTM"](torch.randint(4, 100, (3, 5)))
    assert logits.shape == (3, 2)
