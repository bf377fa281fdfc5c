"""Every config parses with fairseq's real argument parsers, with its arch registered:
option names drifting in a model file break this test, not a GPU week later."""

import importlib
import pkgutil
from pathlib import Path

import pytest
import yaml

from fairseq_plugins.recipes import config as config_mod
from fairseq_plugins.recipes.config import (
    ConfigError,
    all_configs,
    generate_flags,
    load_config,
    load_tables,
    train_flags,
)
from fairseq_plugins.recipes.results_table import render, table_configs

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
    # Table 5 prints l = 64 for 19.84; the text and Table 6 say l = 32: the config runs 32 and says why
    table5 = by_name["bpt/table5_bpt_k4_l32"]
    assert table5["row"] == "BPT (k = 4, l = 64)" and table5["reported"] == {"tokenized": 19.84}
    assert table5["task"] == {"task": "document_translation", "context-tokens": 32} and "contradicts" in table5["note"]
    assert config_mod.run_key(table5) == config_mod.run_key(by_name["bpt/table6_bpt_k4_l32"])
    # scoring as each paper: BPT Table 7's footnote signature names the intl tokenizer
    assert {c["sacrebleu_tokenize"] for c in CONFIGS if c["table"] == "bpt-table7"} == {"intl"}
    translation = [c for c in CONFIGS
                   if c["task"].get("task") not in ("sentence_prediction", "sequence_tagging", "language_modeling")]
    assert all("sacrebleu_tokenize" in c for c in translation)
    # TranSFormer En-De validates on newstest2016 (its data recipe); Zh-En baselines read words
    # (its low-resource samples and BPE sizes are that recipe too: wmt14-en-de-slowfast-*)
    assert {c["data"].split("-slowfast")[0] + "-slowfast" for c in CONFIGS if c["paper"] == "slowfast"
            and "En-De" not in c["column"] and "wmt14" in c["data"]} == {"wmt14-en-de-slowfast"}
    assert by_name["slowfast/table2_transformer_big"]["data"] == "wmt17-zh-en"
    assert by_name["slowfast/table2_transformer_big_characters"]["data"] == "wmt17-zh-en-characters"
    assert by_name["slowfast/table1_transformer_base"]["reported"] == {"tokenized": 28.56, "sacrebleu": 27.6}
    assert by_name["slowfast/table2_transformer_slowfast_h64"]["generate"]["lenpen"] == 1.3


def test_update_freq_keeps_the_papers_batch():
    cfg = {"gpus": 8, "train": {"update-freq": 2}}
    assert config_mod.scaled_update_freq(cfg, 8) == 2
    assert config_mod.scaled_update_freq(cfg, 2) == 8
    assert config_mod.scaled_update_freq(cfg, 3) == 6  # rounded up: at least the paper's batch


def test_more_devices_than_the_papers_batches_share_one_batch():
    """An IWSLT config (one GPU) on 8 GPUs: each takes an eighth of the batch, not 8x the paper's."""
    cfg = {"name": "x", "gpus": 1, "train": {"max-tokens": 4096, "batch-size": 128}}
    assert config_mod.train_options(cfg, 8) == {"max-tokens": 512, "batch-size": 16, "update-freq": 1}
    assert config_mod.train_options(cfg, 3) == {"max-tokens": 1365, "batch-size": 42, "update-freq": 1}
    assert config_mod.train_options(cfg, 1) == {"max-tokens": 4096, "batch-size": 128, "update-freq": 1}
    assert config_mod.train_options(cfg, 8, update_freq=2)["max-tokens"] == 4096  # asked for: as given
    doubled = {"name": "x", "gpus": 2, "train": {"max-tokens": 4096, "update-freq": 2}}
    assert config_mod.train_options(doubled, 8) == {"max-tokens": 2048, "update-freq": 1}
    with pytest.raises(ConfigError, match=r"the paper's batch \(1 x --batch-size 2\) cannot be split over 4 devices"):
        config_mod.train_options({"name": "x", "gpus": 1, "train": {"batch-size": 2}}, 4)


def test_bad_configs_are_rejected(tmp_path):
    good = yaml.safe_load(Path(config_mod.CONFIG_DIR / "bpt" / "table7_transformer.yaml").read_text())
    for change, message in [({"arch": None}, "must be a str"), ({"typo": 1}, "unknown key"),
                            ({"reported": {"bleu": 1.0}}, "reported must map"),
                            ({"sacrebleu_tokenize": "moses"}, "sacrebleu_tokenize must be one of"),
                            ({"train": {"save-dir": "x"}}, "scripts set themselves")]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.dump({**good, **change}))
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_results_table_shows_paper_and_our_numbers(tmp_path):
    import json

    (tmp_path / "bpt").mkdir()
    signature = "nrefs:1|case:mixed|eff:no|tok:intl|smooth:exp|version:2.6.0"
    (tmp_path / "bpt" / "table7_bpt_k4.json").write_text(json.dumps(
        {"sacrebleu": 27.31, "sacrebleu_signature": signature, "test_set": "sacrebleu -t wmt14 -l en-de"}))
    text = render("bpt-table7", tmp_path, CONFIGS)
    lines = text.splitlines()
    assert lines[0].startswith("### BPT Table 7")
    # the signature and test set stand beside the number they belong to
    assert f"| BPT (k = 4) | 27.60 | 27.31 | sacrebleu -t wmt14 -l en-de, SacreBLEU `{signature}` |" in lines
    assert "| ByteNet (Kalchbrenner et al., 2016) | 23.75 | - | prior work, not rerun |" in lines
    assert any("`bpt/table7_bpt_k1` not evaluated" in line for line in lines)
    # rows come in the paper's order
    order = [line.split(" | ")[0][2:] for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert order[:4] == ["ByteNet (Kalchbrenner et al., 2016)", "GNMT+RL (Wu et al., 2016)",
                         "ConvS2S (Gehring et al., 2017)", "Transformer (Vaswani et al., 2017)"]


@pytest.mark.parametrize("context,mark", [("translations", None), ("oracle-reference", "**oracle context**"),
                                          ("same-pass", "same-pass")])
def test_results_table_marks_numbers_not_made_with_the_models_own_context(tmp_path, context, mark):
    import json

    (tmp_path / "bpt").mkdir()
    (tmp_path / "bpt" / "table6_bpt_k4_l32.json").write_text(json.dumps(
        {"tokenized": 19.5, "tokenized_signature": "nrefs:1|tok:none", "test_set": "iwslt15-zh-en test",
         "target_context": context}))
    row = next(line for line in render("bpt-table6", tmp_path, CONFIGS).splitlines() if line.startswith("| BPT (k=4)"))
    assert "19.50" in row and "32: iwslt15-zh-en test, tok. BLEU `nrefs:1|tok:none`" in row
    assert (mark in row) if mark else ("oracle" not in row and "same-pass" not in row)


def test_target_context_of_a_config_and_its_overrides():
    by_name = {c["name"]: c for c in CONFIGS}
    assert config_mod.target_context(by_name["bpt/table7_bpt_k4"]) is None  # sentence-level
    doc = by_name["bpt/table6_bpt_k4_l32"]
    assert config_mod.target_context(doc) == "translations"
    assert config_mod.target_context(doc, ["--beam", "2", "--target-context", "oracle-reference"]) == "oracle-reference"


def test_results_table_says_when_a_row_trained_on_less_data_than_the_paper(tmp_path):
    import json

    (tmp_path / "slowfast").mkdir()
    (tmp_path / "slowfast" / "table2_transformer_big.json").write_text(json.dumps(
        {"tokenized": 20.1, "tokenized_signature": "tok:none", "test_set": "sacrebleu -t wmt17 -l zh-en",
         "training_pairs": 227_062, "paper_training_pairs": 18_000_000}))
    row = next(line for line in render("slowfast-table2", tmp_path, CONFIGS).splitlines()
               if "20.10" in line)
    assert "trained on 227,062 pairs, the paper on about 18,000,000" in row
