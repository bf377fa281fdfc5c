"""The language-model tables' configs: each parses, and fairseq's own parsers accept its
training and evaluation flags (so a typo fails here, not hours into a run)."""

import pytest

pytest.importorskip("fairseq")
from fairseq import options  # noqa: E402

from fairseq_plugins.recipes import evaluate_lm  # noqa: E402
from fairseq_plugins.recipes.config import all_configs, load_tables, train_flags  # noqa: E402

LM_TABLES = ("bpt-table3", "bpt-table4", "bpt-figure5", "segtree-table1")
CONFIGS = [c for c in all_configs() if c["table"] in LM_TABLES]


def test_every_table_has_its_configs():
    tables = load_tables()
    for table in LM_TABLES:
        labels = [r for r in tables[table]["rows"] if isinstance(r, str)]
        cells = {(c["row"], c["column"]) for c in CONFIGS if c["table"] == table}
        assert cells == {(r, col) for r in labels for col in tables[table]["columns"]}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_fairseq_accepts_the_flags(cfg, tmp_path):
    (tmp_path / "dict.txt").write_text("a 1\nb 1\n")
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       [str(tmp_path), *train_flags(cfg, world_size=1), "--cpu"])
    assert args.task == "language_modeling" and args.arch == cfg["arch"]
    assert args.tokens_per_sample == cfg["task"]["tokens-per-sample"]
    evaluation = options.parse_args_and_arch(options.get_eval_lm_parser(),
                                             [str(tmp_path), "--path", "x.pt", *evaluate_lm.eval_lm_flags(cfg, "test")])
    assert evaluation.tokens_per_sample == cfg["evaluate"]["tokens-per-sample"]
    assert evaluate_lm.metric_of(cfg) in cfg["reported"] or not cfg["reported"]


def test_dev_columns_score_the_valid_split():
    for cfg in CONFIGS:
        assert cfg["evaluate"].get("subset", "test") == ("valid" if cfg["column"].endswith("dev") else "test")


def test_parse_eval_lm_output():
    out = ("2026-11-25 | INFO | fairseq_cli.eval_lm | Evaluated 5,000 tokens in 2.0s (2500.00 tokens/s)\n"
           "2026-11-25 | INFO | fairseq_cli.eval_lm | Loss (base 2): 1.2345, Perplexity: 2.35\n")
    with pytest.raises(ValueError, match="no loss line"):
        evaluate_lm.parse("nothing")
    parsed = evaluate_lm.parse(out)
    assert parsed == {"loss_base2": 1.2345, "tokens": 5000, "tokens_per_second": 2500.0}


def test_the_context_length_bounds_positions_or_its_absence_is_named():
    from argparse import Namespace

    from omegaconf import OmegaConf

    from fairseq_plugins.models.model_options import lm_max_positions

    args = Namespace(tokens_per_sample=512, max_target_positions=None)
    lm_max_positions(args, "bpt_lm")
    assert args.max_target_positions == 512
    kept = Namespace(tokens_per_sample=512, max_target_positions=4096)
    lm_max_positions(kept, "bpt_lm")
    assert kept.max_target_positions == 4096
    hydra_model = OmegaConf.create({"max_target_positions": None})  # a model section without the line
    with pytest.raises(ValueError, match=r"bpt_lm needs the context length.*tokens_per_sample: \$\{task"):
        lm_max_positions(hydra_model, "bpt_lm")
