"""Every table row parses with fairseq's real argument parsers, with its arch registered (option
names drifting in a model file break this test, not a GPU week later); the table files' schema,
sources, sweeps and base files; the results table."""

import importlib
import pkgutil
import re

import pytest
import yaml

from fairseq_plugins.recipes import config as config_mod
from fairseq_plugins.recipes.config import (
    FIGURES,
    ConfigError,
    all_configs,
    generate_flags,
    load_tables,
    train_flags,
)
from fairseq_plugins.recipes.results_table import render
from tests.cli import REPO

# the fairseq rows; a measured figure's rows name its models in evaluate (tests/recipes/test_figure_tables.py)
CONFIGS = [c for c in all_configs() if c["measure"] not in FIGURES]


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
        cells = {(c["row"], c["column"]) for c in spec["configs"]}
        for row in spec["rows"]:
            if isinstance(row, str):
                for col in spec["columns"]:
                    assert (row, col) in cells, f"{table_id}: {row!r} / {col!r} has no config"


def test_reported_numbers_of_key_rows():
    by_name = {c["name"]: c for c in CONFIGS}
    assert by_name["bpt-table7/bpt-k4"]["reported"] == {"sacrebleu": 27.6}
    # Table 5 prints l = 64 for 19.84; the text and Table 6 say l = 32: the config runs 32 and says why
    table5 = by_name["bpt-table5/bpt-k4-l32"]
    assert table5["row"] == "BPT (k = 4, l = 64)" and table5["reported"] == {"tokenized": 19.84}
    assert table5["task"] == {"task": "document_translation", "context-tokens": 32, "document-samples": "chunks"} \
        and "Table 5 labels it l = 64" in table5["sources"]["task.context-tokens"]
    assert config_mod.run_key(table5) == config_mod.run_key(by_name["bpt-table6/bpt-k4-l32"])
    # scoring as each paper: BPT Table 7's footnote signature names the intl tokenizer
    assert {c["sacrebleu_tokenize"] for c in CONFIGS if c["table"] == "bpt-table7"} == {"intl"}
    translation = [c for c in CONFIGS
                   if c["task"].get("task") not in ("sentence_prediction", "sequence_tagging", "language_modeling")]
    assert all("sacrebleu_tokenize" in c for c in translation)
    # TranSFormer En-De validates on newstest2016 (its data recipe); Zh-En baselines read words
    # (its low-resource samples and BPE sizes are that recipe too: wmt14-en-de-slowfast-*)
    assert {c["data"].split("-slowfast")[0] + "-slowfast" for c in CONFIGS if c["paper"] == "slowfast"
            and "En-De" not in c["column"] and "wmt14" in c["data"]} == {"wmt14-en-de-slowfast"}
    assert by_name["slowfast-table2/transformer-big"]["data"] == "wmt17-zh-en"
    assert by_name["slowfast-table2/transformer-big-characters"]["data"] == "wmt17-zh-en-characters"
    assert by_name["slowfast-table1/transformer-base"]["reported"] == {"tokenized": 28.56, "sacrebleu": 27.6}
    assert by_name["slowfast-table2/transformer-slowfast-h64"]["generate"]["lenpen"] == 1.3


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


TINY = {"data": "multi30k-en-de", "arch": "transformer", "gpus": 1, "average_last": 0,
        "task": {"task": "translation"}, "train": {"lr": 0.001}}


def _table(tmp_path, rows=None, **top):
    """A table file with one good row unless ``rows`` is given; returns its path."""
    spec = {"table": "t", "title": "T", "paper": "bpt", "metric": "sacrebleu",
            "defaults": TINY, "sources": {k: "ours: a test" for k in config_mod.flatten(TINY)},
            "rows": rows if rows is not None else [{"id": "a", "row": "A"}], **top}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.parametrize("rows,top,message", [
    ([{"id": "a", "row": "A", "typo": 1}], {}, r"t.yaml: row 'a': key typo: Key 'typo' not in 'Row'"),
    ([{"id": "a", "row": "A", "gpus": "many"}], {}, r"row 'a': key gpus: Value 'many'"),
    ([{"id": "a"}], {}, r"row 'a': key row: Missing mandatory value"),
    (None, {"title": None}, r"t.yaml: key title: Incompatible value 'None'"),
    ([{"id": "a", "row": "A", "data": None}], {"defaults": {**TINY, "data": None}}, "row 'a': missing 'data'"),
    ([{"id": "a", "row": "A", "reported": {"bleu": 1.0}}], {}, "reported must map metrics"),
    ([{"id": "a", "row": "A", "sacrebleu_tokenize": "moses", "sources": {"sacrebleu_tokenize": "ours: x"}}], {},
     "sacrebleu_tokenize must be one of"),
    ([{"id": "a", "row": "A", "train": {"save-dir": "x"}, "sources": {"train.save-dir": "ours: x"}}], {},
     "scripts set themselves"),
    ([{"id": "a", "row": "A", "model": {"dropout": 0.3}}], {}, r"row 'a': model.dropout = 0.3 has no source"),
    ([{"id": "a", "row": "A", "model": {"dropout": 0.3}, "sources": {"model.dropout": "the paper"}}], {},
     "the source of model.dropout must read 'paper: <where>'"),
    ([{"id": "a", "row": "A", "sources": {"model.dropout": "ours: x"}}], {},
     "a source for model.dropout, which no row"),
    ([{"id": "a", "row": "A", "sources": {"arch": "original: yzh119/BPT@main configs/x.yml"}}], {},
     "the source of arch must read"),
    ([{"id": "a", "row": "A"}, {"id": "a", "row": "B"}], {}, "row 'a': two rows have this id"),
    ([{"row": "A"}], {}, "row 'A' needs an id"),
    ([{"id": "a", "row": "A", "column": "Big"}], {}, "column 'Big' is not one of"),
    ([{"id": "k{model.k}", "row": "A", "sweep": {"model.k": [1]}}], {}, "model.k = 1 has no source"),
    ([{"id": "k{model.x}", "row": "A", "sweep": {"model.k": [1]}, "sources": {"model.k": "ours: x"}}], {},
     r"\{model.x\} in 'k\{model.x\}' names no value"),
    ([{"id": "a", "row": "A", "sweep": {"dropout": [1]}}], {}, "sweep key 'dropout' is neither"),
    (None, {"base": ["nowhere.yaml"]}, "base 'nowhere.yaml' is no file"),
])
def test_table_files_are_refused_naming_file_row_and_key(tmp_path, rows, top, message):
    path = _table(tmp_path, rows, **top)
    with pytest.raises(ConfigError, match=message):
        config_mod.load_table(str(path))


def test_a_sweep_is_one_row_per_value_and_a_row_overrides_the_defaults(tmp_path):
    rows = [{"id": "k{model.graph-k}-{data}", "row": "BPT (k = {model.graph-k})", "arch": "bpt_transformer",
             "sweep": {"model.graph-k": [1, 4], "data": ["a", "b"]},
             "sources": {"model.graph-k": "paper: Table 7", "arch": "paper: Sec. 4.3"}},
            {"id": "plain", "row": "Transformer", "train": {"lr": None}}]  # null unsets a default
    table = config_mod.load_table(str(_table(tmp_path, rows)))
    assert [c["id"] for c in table["configs"]] == ["k1-a", "k1-b", "k4-a", "k4-b", "plain"]
    assert table["rows"] == ["BPT (k = 1)", "BPT (k = 4)", "Transformer"]
    k4 = config_mod.load_config(f"{tmp_path / 't.yaml'}:k4-b")
    assert k4["model"] == {"graph-k": 4} and k4["data"] == "b" and k4["arch"] == "bpt_transformer"
    assert k4["name"] == "t/k4-b" and k4["sources"]["model.graph-k"] == "paper: Table 7"
    assert table["configs"][-1]["train"] == {} and table["configs"][-1]["arch"] == "transformer"
    with pytest.raises(ConfigError, match="t has no row 'k8'; rows: k1-a, k1-b"):
        config_mod.load_config(f"{tmp_path / 't.yaml'}:k8")
    with pytest.raises(ConfigError, match="name a row, TABLE:ROW"):
        config_mod.load_config(str(tmp_path / "t.yaml"))


def test_a_sweep_of_cases_varies_values_together_each_with_its_number(tmp_path):
    rows = [{"id": "l{task.tokens-per-sample}", "row": "l = {task.tokens-per-sample}", "reported": {"bpc": 9.0},
             "sweep": [{"task.tokens-per-sample": 512, "model.clip": 2, "reported": {"bpc": 1.07}},
                       {"task.tokens-per-sample": 1024, "model.clip": 3}],
             "sources": {"task.tokens-per-sample": "paper: Table 4", "model.clip": "ours: x"}}]
    table = config_mod.load_table(str(_table(tmp_path, rows, metric="bpc")))
    l512, l1024 = table["configs"]
    assert (l512["id"], l512["model"], l512["reported"]) == ("l512", {"clip": 2}, {"bpc": 1.07})
    assert (l1024["row"], l1024["model"], l1024["reported"]) == ("l = 1024", {"clip": 3}, {"bpc": 9.0})
    for bad in ([1, 2], {"model.clip": 3}):
        with pytest.raises(ConfigError, match="sweep"):
            config_mod.load_table(str(_table(tmp_path, [dict(rows[0], sweep=bad)], metric="bpc")))


def test_base_files_merge_first_and_their_sources_count(tmp_path, monkeypatch):
    monkeypatch.setattr(config_mod, "CONFIG_DIR", tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "outer.yaml").write_text(yaml.safe_dump(
        {"base": ["b/inner.yaml"], "defaults": {"model": {"dropout": 0.2}}, "sources": {"model.dropout": "ours: b"}}))
    (tmp_path / "b" / "inner.yaml").write_text(yaml.safe_dump(
        {"defaults": {"model": {"dropout": 0.1, "layers": 2}}, "sources": {"model.layers": "paper: Table 1"}}))
    cfg = config_mod.load_table(str(_table(tmp_path, base=["b/outer.yaml"])))["configs"][0]
    assert cfg["model"] == {"dropout": 0.2, "layers": 2}
    assert cfg["sources"]["model.layers"] == "paper: Table 1" and cfg["sources"]["model.dropout"] == "ours: b"
    (tmp_path / "b" / "inner.yaml").write_text(yaml.safe_dump({"base": ["b/outer.yaml"]}))
    with pytest.raises(ConfigError, match="cycle: b/outer.yaml -> b/inner.yaml -> b/outer.yaml"):
        config_mod.load_table(str(_table(tmp_path, base=["b/outer.yaml"])))


def test_a_rows_base_files_merge_over_the_tables_defaults_under_the_row(tmp_path, monkeypatch):
    """One column's settings (IMDB's) in a table whose defaults are another's (SST-5's): a row's base."""
    monkeypatch.setattr(config_mod, "CONFIG_DIR", tmp_path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "other.yaml").write_text(yaml.safe_dump(
        {"defaults": {"data": "other", "model": {"dropout": 0.5, "layers": 5}, "train": {"lr": None}},
         "sources": {"data": "paper: other", "model.dropout": "ours: other", "model.layers": "ours: other"}}))
    rows = [{"id": "a", "row": "A"}, {"id": "b", "row": "B", "base": ["b/other.yaml"], "model": {"layers": 6},
                                      "sources": {"model.layers": "ours: b"}}]
    a, b = config_mod.load_table(str(_table(tmp_path, rows)))["configs"]
    assert (a["data"], a["model"], a["train"]) == ("multi30k-en-de", {}, {"lr": 0.001})
    assert (b["data"], b["model"], b["train"], b["arch"]) == ("other", {"dropout": 0.5, "layers": 6}, {}, "transformer")
    assert (b["sources"]["data"], b["sources"]["model.dropout"], b["sources"]["model.layers"]) == (
        "paper: other", "ours: other", "ours: b")
    with pytest.raises(ConfigError, match="row 'b': base 'b/none.yaml' is no file"):
        config_mod.load_table(str(_table(tmp_path, [dict(rows[1], base=["b/none.yaml"])])))


def test_every_shipped_value_has_a_source_and_removing_one_is_refused(tmp_path):
    for cfg in CONFIGS:
        assert set(config_mod.flatten(cfg)) <= set(cfg["sources"]), cfg["name"]
    shipped = config_mod.load_tables()["bpt-table7"]["file"]
    spec = yaml.safe_load(shipped.read_text())
    sourced = spec.get("sources") or spec["rows"][-1]["sources"]
    key = next(iter(sourced))
    del sourced[key]
    broken = tmp_path / "table7.yaml"
    broken.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(ConfigError, match=f"{re.escape(key)} = .* has no source"):
        config_mod.load_table(str(broken))


def test_sources_of_the_original_name_a_commit():
    originals = {s for c in CONFIGS for s in c["sources"].values() if s.startswith("original: ")}
    assert originals, "no value cites an original file"
    assert all(re.fullmatch(r"original: [\w.-]+/[\w.-]+@[0-9a-f]{7,40} \S.*", s, re.S) for s in originals)


def test_results_table_shows_paper_and_our_numbers(tmp_path):
    import json

    (tmp_path / "bpt-table7").mkdir()
    signature = "nrefs:1|case:mixed|eff:no|tok:intl|smooth:exp|version:2.6.0"
    (tmp_path / "bpt-table7" / "bpt-k4.json").write_text(json.dumps(
        {"sacrebleu": 27.31, "sacrebleu_signature": signature, "test_set": "sacrebleu -t wmt14 -l en-de"}))
    text = render("bpt-table7", tmp_path)
    lines = text.splitlines()
    assert lines[0].startswith("### BPT Table 7")
    # the signature and test set stand beside the number they belong to
    assert f"| BPT (k = 4) | 27.60 | 27.31 | sacrebleu -t wmt14 -l en-de, SacreBLEU `{signature}` |" in lines
    assert "| ByteNet (Kalchbrenner et al., 2016) | 23.75 | - | prior work, not rerun |" in lines
    assert any("`bpt-table7/bpt-k1` not evaluated" in line for line in lines)
    # rows come in the paper's order
    order = [line.split(" | ")[0][2:] for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert order[:4] == ["ByteNet (Kalchbrenner et al., 2016)", "GNMT+RL (Wu et al., 2016)",
                         "ConvS2S (Gehring et al., 2017)", "Transformer (Vaswani et al., 2017)"]


@pytest.mark.parametrize("context,mark", [("translations", None), ("oracle-reference", "**oracle context**"),
                                          ("same-pass", "same-pass")])
def test_results_table_marks_numbers_not_made_with_the_models_own_context(tmp_path, context, mark):
    import json

    (tmp_path / "bpt-table6").mkdir()
    (tmp_path / "bpt-table6" / "bpt-k4-l32.json").write_text(json.dumps(
        {"tokenized": 19.5, "tokenized_signature": "nrefs:1|tok:none", "test_set": "iwslt15-zh-en test",
         "target_context": context}))
    row = next(line for line in render("bpt-table6", tmp_path).splitlines() if line.startswith("| BPT (k=4)"))
    assert "19.50" in row and "32: iwslt15-zh-en test, tok. BLEU `nrefs:1|tok:none`" in row
    assert (mark in row) if mark else ("oracle" not in row and "same-pass" not in row)


def test_target_context_of_a_config_and_its_overrides():
    by_name = {c["name"]: c for c in CONFIGS}
    assert config_mod.target_context(by_name["bpt-table7/bpt-k4"]) is None  # sentence-level
    doc = by_name["bpt-table6/bpt-k4-l32"]
    assert config_mod.target_context(doc) == "same-pass"  # the original's mt_infer.py
    assert config_mod.target_context(doc, ["--beam", "2", "--target-context", "translations"]) == "translations"


def test_results_table_says_when_a_row_trained_on_less_data_than_the_paper(tmp_path):
    import json

    (tmp_path / "slowfast-table2").mkdir()
    (tmp_path / "slowfast-table2" / "transformer-big.json").write_text(json.dumps(
        {"tokenized": 20.1, "tokenized_signature": "tok:none", "test_set": "sacrebleu -t wmt17 -l zh-en",
         "training_pairs": 227_062, "paper_training_pairs": 18_000_000}))
    row = next(line for line in render("slowfast-table2", tmp_path).splitlines()
               if "20.10" in line)
    assert "trained on 227,062 pairs, the paper on about 18,000,000" in row


def test_the_table_file_the_docs_show_whole_is_the_shipped_one():
    repo = REPO
    docs = (repo / "docs" / "reproduce.md").read_text(encoding="utf-8")
    shipped = (repo / "configs" / "slowfast" / "table4b.yaml").read_text(encoding="utf-8")
    assert f"```yaml\n{shipped}```" in docs
