"""The TranSFormer rows added beside the main tables: fast-only and character-level encoders (Tables 1
and 4b), the low-resource samples (Table 7) and the depth and BPE sweeps (Figure 5). Every config
parses with fairseq's parser and builds its model (on the meta device, at the paper's size); the
sweeps differ from the Table 1 models only in what they sweep."""

import itertools
import string

import pytest
import torch

from fairseq import options, tasks
from fairseq_plugins.recipes.config import all_configs, load_tables, run_key, train_flags

CONFIGS = {c["name"]: c for c in all_configs()}
CELLS = {(c["table"], c["row"], c["column"]): c for c in CONFIGS.values()}  # the paper's table, row and column
NEW_TABLES = ("slowfast-table7", "slowfast-figure5a", "slowfast-figure5b")
NEW = sorted(name for name, c in CONFIGS.items() if c["table"] in NEW_TABLES or name.startswith(
    ("slowfast-table1/fast-only", "slowfast-table1/transformer-characters", "slowfast-table4b/fast-only")))
JOINT_BPE_TYPES = 32768  # about the size of the joined dictionary of 32k joint BPE merges
# the paper's parameter counts (Table 1), in millions
PAPER_PARAMS = {"slowfast-table4b/fast-only": 42, "slowfast-table1/fast-only-h512-base": 64,
                "slowfast-table1/fast-only-h512-big": 211, "slowfast-table1/transformer-characters-base": 63,
                "slowfast-table1/transformer-characters-big": 208}


def _dictionary_files(tmp_path, n=200):
    """A joined subword-nmt style dictionary (letters, some with @@) for both languages."""
    words = ("".join(w) for w in itertools.product(string.ascii_lowercase, repeat=2))
    text = "".join(f"{w}{'@@' if i % 3 == 0 else ''} {n - i}\n" for i, w in zip(range(n), words))
    for lang in ("en", "de"):
        (tmp_path / f"dict.{lang}.txt").write_text(text)


def _build_on_meta(cfg, tmp_path):
    _dictionary_files(tmp_path)
    argv = [str(tmp_path), "-s", "en", "-t", "de", *train_flags(cfg, world_size=1)]
    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    task = tasks.setup_task(args)
    with torch.device("meta"):
        model = task.build_model(args)
    return args, task, model


def test_the_new_rows_are_there():
    assert len(NEW) == 5 + 9 + 8 + 10
    tables = load_tables()
    assert all(t in tables for t in NEW_TABLES)
    assert {c["row"] for c in CONFIGS.values() if c["table"] == "slowfast-table7"} == {
        "1 TranSFormer", "2 Character-only", "3 Subword-only"}


@pytest.mark.parametrize("name", NEW)
def test_config_builds_its_model(name, tmp_path):
    cfg = CONFIGS[name]
    args, task, model = _build_on_meta(cfg, tmp_path)
    enc = model.encoder
    model_opts = cfg["model"]
    assert len(enc.layers) == (0 if model_opts.get("no-slow-branch") else model_opts.get("encoder-layers", 6))
    assert enc.has_fast_branch == (not model_opts.get("no-fast-branch", False))
    if model_opts.get("no-slow-branch"):
        assert enc.output == "fast" and len(enc.fast_layers) == 6
        assert enc.fast_embed_tokens.embedding_dim == model_opts.get("fast-embed-dim", 32)
    if name in PAPER_PARAMS:
        n = sum(p.numel() for p in model.parameters())
        n += (JOINT_BPE_TYPES - len(task.source_dictionary)) * args.encoder_embed_dim  # the one shared embedding
        assert abs(n / 1e6 - PAPER_PARAMS[name]) / PAPER_PARAMS[name] < 0.05, (name, n)


def _same_but(a, b, *sections):
    """Two configs are the same experiment apart from the named keys (``model.encoder-layers`` style)."""
    strip = {"table", "row", "column", "reported", "note", "name", "id", "sources"}
    a, b = ({k: dict(v) if isinstance(v, dict) else v for k, v in c.items() if k not in strip} for c in (a, b))
    for key in sections:
        section, _, option = key.partition(".")
        for c in (a, b):
            if option:
                c[section].pop(option, None)
            else:
                c.pop(section, None)
    return a == b


BASELINES = {"Baseline": "slowfast-table1/slow-only-base", "TranSFormer": "slowfast-table1/transformer-base"}


@pytest.mark.parametrize("model", sorted(BASELINES))
def test_the_sweeps_change_only_what_they_sweep(model):
    base = CONFIGS[BASELINES[model]]
    for layers in (6, 12, 18, 24):
        cfg = CELLS["slowfast-figure5a", model, str(layers)]
        assert cfg["model"].get("encoder-layers", 6) == layers
        assert _same_but(cfg, base, "model.encoder-layers")
    assert run_key(CELLS["slowfast-figure5a", model, "6"]) == run_key(base)  # Table 1's run
    for merges in (10, 20, 30, 40, 50):
        cfg = CELLS["slowfast-figure5b", model, f"{merges}K"]
        assert cfg["data"] == f"wmt14-en-de-slowfast-bpe{merges}k" and cfg["column"] == f"{merges}K"
        assert _same_but(cfg, base, "data")


def test_low_resource_rows_are_the_table1_models_on_the_samples():
    models = {"1 TranSFormer": CONFIGS["slowfast-table1/transformer-base"],
              "3 Subword-only": CONFIGS["slowfast-table1/slow-only-base"],
              "2 Character-only": CONFIGS["slowfast-table1/transformer-characters-base"]}
    paper = {"1 TranSFormer": (11.87, 22.75, 25.3), "2 Character-only": (10.5, 20.5, 22.5),
             "3 Subword-only": (7.0, 22.0, 23.5)}
    for name, base in models.items():
        for size, reported in zip(("50k", "500k", "1000k"), paper[name]):
            cfg = CELLS["slowfast-table7", name, size.upper()]
            assert cfg["data"] == f"wmt14-en-de-slowfast-{size}" and cfg["reported"] == {"tokenized": reported}
            assert cfg["column"] == size.upper() and cfg["average_last"] == 0 and cfg["train"]["patience"] == 10
            assert _same_but(cfg, base, "data", "average_last", "train.warmup-updates", "train.patience")


def test_fast_only_rows_report_the_papers_numbers():
    assert CONFIGS["slowfast-table4b/fast-only"]["reported"] == {"tokenized": 17.9}
    assert CONFIGS["slowfast-table1/fast-only-h512-base"]["reported"] == {"tokenized": 27.11, "sacrebleu": 26.1}
    assert CONFIGS["slowfast-table1/fast-only-h512-big"]["reported"] == {"tokenized": 28.65, "sacrebleu": 27.6}
    assert CONFIGS["slowfast-table1/transformer-characters-base"]["reported"] == {"tokenized": 26.56}
    assert CONFIGS["slowfast-table1/transformer-characters-big"]["reported"] == {"tokenized": 28.05}
    assert all("reported" not in c or not c["reported"] for n, c in CONFIGS.items() if "/figure5" in n)
