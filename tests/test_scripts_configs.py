"""Every config parses with fairseq's real argument parsers, with its arch registered:
option names drifting in a model file break this test, not a GPU week later."""

import importlib
import pkgutil
from pathlib import Path

import pytest
import yaml

from scripts import config as config_mod
from scripts.config import ConfigError, all_configs, generate_flags, load_config, load_tables, train_flags
from scripts.results_table import render, table_configs

CONFIGS = all_configs()


def _register_plugin():
    """Import every model and task module (what --user-dir does), once per process."""
    import fairseq_plugins

    for sub in ("models", "tasks"):
        pkg = importlib.import_module(f"fairseq_plugins.{sub}")
        for info in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"fairseq_plugins.{sub}.{info.name}")
    return fairseq_plugins


@pytest.fixture(scope="module")
def fairseq_options():
    _register_plugin()
    from fairseq import options

    return options


def _parse(options, parser, argv):
    try:
        return options.parse_args_and_arch(parser, argv)
    except SystemExit as err:  # argparse reports to stderr and exits
        raise AssertionError(f"fairseq rejected: {' '.join(argv)}") from err


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["name"] for c in CONFIGS])
def test_config_matches_registered_arch_and_options(cfg, fairseq_options, tmp_path):
    from fairseq.models import ARCH_MODEL_REGISTRY

    assert cfg["arch"] in ARCH_MODEL_REGISTRY, f"{cfg['name']}: arch {cfg['arch']} is not registered"
    args = _parse(fairseq_options, fairseq_options.get_training_parser(),
                  [str(tmp_path), "--save-dir", str(tmp_path), *train_flags(cfg, world_size=1)])
    assert args.arch == cfg["arch"]
    for key, value in {**cfg["model"], **cfg["task"]}.items():
        dest = key.replace("-", "_")
        assert hasattr(args, dest), f"{cfg['name']}: option --{key} did not reach the args"
        if value is not True and isinstance(value, (int, float)) and not isinstance(value, bool):
            assert getattr(args, dest) == value, f"{cfg['name']}: --{key}"
    _parse(fairseq_options, fairseq_options.get_generation_parser(),
           [str(tmp_path), "--path", str(tmp_path / "x.pt"), *generate_flags(cfg)])


def test_configs_fill_every_table_cell_and_rows_exist():
    tables = load_tables()
    assert {c["table"] for c in CONFIGS} <= set(tables)
    for table_id, spec in tables.items():
        cells = {(c["row"], c["column"]) for c in table_configs(table_id, CONFIGS)}
        for row in spec["rows"]:
            if isinstance(row, str):
                for col in spec["columns"]:
                    assert (row, col) in cells, f"{table_id}: {row!r} / {col!r} has no config"


def test_reported_numbers_of_key_rows():
    by_name = {c["name"]: c for c in CONFIGS}
    assert by_name["bpt/table7_bpt_k4"]["reported"] == {"sacrebleu": 27.6}
    assert by_name["bpt/table5_bpt_k4_l64"]["task"] == {"task": "document_translation", "context-tokens": 64}
    assert by_name["slowfast/table1_transformer_base"]["reported"] == {"tokenized": 28.56, "sacrebleu": 27.6}
    assert by_name["slowfast/table2_transformer_slowfast_h64"]["generate"]["lenpen"] == 1.3


def test_update_freq_keeps_the_papers_batch():
    cfg = {"gpus": 8, "train": {"update-freq": 2}}
    assert config_mod.scaled_update_freq(cfg, 8) == 2
    assert config_mod.scaled_update_freq(cfg, 2) == 8
    assert config_mod.scaled_update_freq(cfg, 3) == 6  # rounded up: at least the paper's batch


def test_bad_configs_are_rejected(tmp_path):
    good = yaml.safe_load(Path(config_mod.CONFIG_DIR / "bpt" / "table7_transformer.yaml").read_text())
    for change, message in [({"arch": None}, "must be a str"), ({"typo": 1}, "unknown key"),
                            ({"reported": {"bleu": 1.0}}, "reported must map"),
                            ({"train": {"save-dir": "x"}}, "scripts set themselves")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.dump({**good, **change}))
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_results_table_shows_paper_and_our_numbers(tmp_path):
    import json

    (tmp_path / "bpt").mkdir()
    (tmp_path / "bpt" / "table7_bpt_k4.json").write_text(json.dumps(
        {"sacrebleu": 27.31, "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"}))
    text = render("bpt-table7", tmp_path, CONFIGS)
    lines = text.splitlines()
    assert lines[0].startswith("### BPT Table 7")
    assert "| BPT (k = 4) | 27.60 | 27.31 |  |" in lines
    assert "| ByteNet (Kalchbrenner et al., 2016) | 23.75 | - | prior work, not rerun |" in lines
    assert any("`bpt/table7_bpt_k1` not evaluated" in line for line in lines)
    assert "tok:13a" in lines[-1]
    # rows come in the paper's order
    order = [line.split(" | ")[0][2:] for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert order[:4] == ["ByteNet (Kalchbrenner et al., 2016)", "GNMT+RL (Wu et al., 2016)",
                         "ConvS2S (Gehring et al., 2017)", "Transformer (Vaswani et al., 2017)"]
