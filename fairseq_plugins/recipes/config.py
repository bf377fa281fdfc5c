"""Experiment configs (``configs/**.yaml``): one file per table row of a paper.

A config holds everything needed to rerun one row::

    paper: bpt                   # which paper the row comes from
    table: bpt-table7            # table id (configs/tables.yaml)
    row: BPT (k = 4)             # row label as printed in the paper
    column: BLEU                 # column label, for tables with several result columns
    reported: {sacrebleu: 27.6}  # the paper's numbers by metric (sacrebleu | tokenized)
    data: wmt14-en-de-bpt        # corpus of fairseq-plugins-prepare-data
    arch: bpt_transformer_wmt_en_de
    task: {task: translation}    # task options, used by training and generation
    model: {...}                 # model options (fairseq-train --help with --arch)
    train: {...}                 # optimisation options
    gpus: 8                      # GPUs the paper's batch assumes; update-freq is rescaled
    average_last: 10             # average the last N epoch checkpoints (0: checkpoint_best)
    generate: {beam: 5, lenpen: 0.6}   # translation: fairseq-generate options
    evaluate: {...}              # other tasks: options of their evaluation command
    sacrebleu_tokenize: intl     # sacrebleu's tokenizer for the detokenized score (default 13a; zh
                                 # for a Chinese target)
    seeds: 10                    # the paper's protocol: N runs (fairseq seeds 1..N), scored as mean and deviation
    note: ...                    # which values the paper leaves open, and what we chose

Options are fairseq command-line flags without the leading ``--``: ``true`` is a bare
flag, ``false``/``null`` leave the flag out, anything else is its value.
"""

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ..resources import resource_dir, user_dir

CONFIG_DIR = resource_dir("configs")
USER_DIR = user_dir()
METRICS = ("sacrebleu", "tokenized", "bpc", "ppl", "accuracy", "f1")  # what ``reported`` may hold

_REQUIRED = {"paper": str, "table": str, "row": str, "data": str, "arch": str,
             "model": dict, "train": dict, "gpus": int, "average_last": int}
_OPTIONAL = {"column": str, "reported": dict, "task": dict, "note": str, "sacrebleu_tokenize": str,
             "generate": dict,  # fairseq-generate options (translation tasks)
             "evaluate": dict,  # options of the task's own evaluation command (e.g. fairseq-eval-lm)
             "seeds": int}  # runs of the paper's protocol (seeds 1..N), scored as mean and deviation
SACREBLEU_TOKENIZERS = ("13a", "intl", "zh", "char", "none")
# flags the scripts set themselves; a config must not carry them
_RESERVED = {"user-dir", "arch", "save-dir", "path", "distributed-world-size", "gen-subset", "remove-bpe",
             "results-path", "cpu"}


class ConfigError(ValueError):
    pass


def find_config(path) -> Path:
    """A config file: ``path`` itself when it exists, else a config shipped with the package
    named by its path under configs/ (``bpt/table7_bpt_k4`` or ``bpt/table7_bpt_k4.yaml``)."""
    path = Path(path)
    if path.exists():
        return path
    relative = Path(*path.parts[1:]) if path.parts[:1] == ("configs",) else path
    shipped = CONFIG_DIR / relative.with_suffix(".yaml")
    if shipped.exists():
        return shipped
    raise ConfigError(f"{path}: no such file, nor a config of {CONFIG_DIR} by that name")


def load_config(path) -> Dict[str, Any]:
    """Read and validate one config (a file, or a shipped config's name); adds ``name``
    (its path relative to configs/)."""
    path = find_config(path)
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for key, typ in _REQUIRED.items():
        if key not in cfg:
            raise ConfigError(f"{path}: missing '{key}'")
        if not isinstance(cfg[key], typ):
            raise ConfigError(f"{path}: '{key}' must be a {typ.__name__}")
    for key in cfg:
        if key not in _REQUIRED and key not in _OPTIONAL:
            raise ConfigError(f"{path}: unknown key '{key}'")
        if key in _OPTIONAL and not isinstance(cfg[key], _OPTIONAL[key]):
            raise ConfigError(f"{path}: '{key}' must be a {_OPTIONAL[key].__name__}")
    for metric, value in (cfg.get("reported") or {}).items():
        if metric not in METRICS or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: reported must map {METRICS} to numbers, got {metric}: {value!r}")
    for section in ("task", "model", "train", "generate", "evaluate"):
        clash = _RESERVED.intersection(cfg.get(section) or {})
        if clash:
            raise ConfigError(f"{path}: '{section}' sets {sorted(clash)}, which the scripts set themselves")
    if cfg.get("sacrebleu_tokenize", "13a") not in SACREBLEU_TOKENIZERS:
        raise ConfigError(f"{path}: sacrebleu_tokenize must be one of {SACREBLEU_TOKENIZERS}")
    if cfg.get("seeds", 1) < 1 or "seed" in cfg["train"] and "seeds" in cfg:
        raise ConfigError(f"{path}: seeds must be >= 1, and a config with seeds sets no train seed")
    if cfg["gpus"] < 1 or cfg["average_last"] < 0:
        raise ConfigError(f"{path}: gpus must be >= 1 and average_last >= 0")
    cfg.setdefault("task", {})
    cfg.setdefault("generate", {})
    cfg.setdefault("evaluate", {})
    cfg.setdefault("column", "BLEU")
    cfg.setdefault("reported", {})
    try:
        cfg["name"] = str(path.resolve().relative_to(CONFIG_DIR)).removesuffix(".yaml")
    except ValueError:
        cfg["name"] = path.stem
    return cfg


def all_configs() -> List[Dict[str, Any]]:
    """Every table-row config: all of configs/ but tables.yaml, the demo's configs (demo*.yaml),
    the quality study's (quality_study.yaml) and the fairseq-hydra-train configs (configs/hydra/)."""
    return [load_config(p) for p in sorted(CONFIG_DIR.rglob("*.yaml"))
            if p.name not in ("tables.yaml", "quality_study.yaml") and not p.name.startswith("demo")
            and p.parent.name != "hydra"]


def to_flags(options: Optional[Dict[str, Any]]) -> List[str]:
    """{'max-tokens': 4096, 'share-all-embeddings': True} -> ['--max-tokens', '4096', '--share-all-embeddings']"""
    flags: List[str] = []
    for key, value in (options or {}).items():
        if value is None or value is False:
            continue
        flags.append(f"--{key}")
        if value is not True:
            flags.append(str(value))
    return flags


def run_key(cfg: Dict[str, Any]) -> str:
    """Name of the training run: configs that train the same model share one run (several
    table rows are the same experiment, e.g. the default TranSFormer in Tables 1 and 4-6)."""
    what = {k: cfg[k] for k in ("data", "arch", "task", "model", "train", "gpus")}
    digest = hashlib.sha1(json.dumps(what, sort_keys=True).encode()).hexdigest()[:8]
    return f"{cfg['data']}.{cfg['arch']}.{digest}"


def seed_configs(cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One config per run of the paper's seed protocol (``seeds: N``: fairseq seeds 1..N), each its
    own training run; a config without ``seeds`` is its only run."""
    if not cfg.get("seeds"):
        return [cfg]
    return [dict(cfg, train=dict(cfg["train"], seed=seed)) for seed in range(1, cfg["seeds"] + 1)]


def scaled_update_freq(cfg: Dict[str, Any], world_size: int) -> int:
    """Keep the paper's tokens per update on ``world_size`` devices instead of ``gpus`` (at least
    1: on more devices than the paper's batches per update, ``train_options`` shrinks the batch)."""
    base = int(cfg["train"].get("update-freq", 1))
    return max(1, math.ceil(base * cfg["gpus"] / world_size))


def train_options(cfg: Dict[str, Any], world_size: int, update_freq: Optional[int] = None) -> Dict[str, Any]:
    """The config's optimisation options on ``world_size`` devices, keeping the paper's batch
    (``gpus`` x batch x update-freq): fewer devices accumulate more batches per update, more
    devices than the paper's batches per update each take a share of one batch (--max-tokens
    and --batch-size divided, rounded down). ``update_freq`` given: exactly that, batch unchanged."""
    if update_freq is not None and update_freq < 1:
        raise ValueError(f"update frequency must be >= 1, got {update_freq}")
    train = dict(cfg["train"])
    per_update = int(train.get("update-freq", 1)) * cfg["gpus"]  # batches per update in the paper
    if update_freq is not None or per_update >= world_size:
        train["update-freq"] = update_freq or scaled_update_freq(cfg, world_size)
        return train
    train["update-freq"] = 1
    for key in ("max-tokens", "batch-size"):
        if key in train and train[key] is not None:
            share = int(train[key]) * per_update // world_size
            if share < 1:
                raise ConfigError(
                    f"{cfg.get('name', 'config')}: the paper's batch ({per_update} x --{key} {train[key]}) cannot "
                    f"be split over {world_size} devices; train on at most {per_update * int(train[key])}"
                )
            train[key] = share
    return train


def train_flags(cfg: Dict[str, Any], world_size: int, update_freq: Optional[int] = None) -> List[str]:
    """fairseq-train flags of a config, without data dir and save dir (see ``train_options``)."""
    return ["--user-dir", str(USER_DIR), "--arch", cfg["arch"],
            *to_flags(cfg["task"]), *to_flags(cfg["model"]), *to_flags(train_options(cfg, world_size, update_freq))]


def generate_flags(cfg: Dict[str, Any]) -> List[str]:
    """fairseq-generate flags of a config, without data dir and checkpoint."""
    return ["--user-dir", str(USER_DIR), *to_flags(cfg["task"]), *to_flags(cfg["generate"])]


def target_context(cfg: Dict[str, Any], extra: Sequence[str] = ()) -> Optional[str]:
    """The target context a document-level config translates with (``--target-context``, last
    one given wins, as in argparse); None for sentence-level tasks."""
    if (cfg.get("task") or {}).get("task") != "document_translation":
        return None
    value = cfg["task"].get("target-context", "translations")
    flags = [*to_flags(cfg["generate"]), *extra]
    for i, flag in enumerate(flags[:-1]):
        if flag == "--target-context":
            value = flags[i + 1]
    return value


def load_tables() -> Dict[str, Any]:
    tables = yaml.safe_load((CONFIG_DIR / "tables.yaml").read_text(encoding="utf-8"))
    if not isinstance(tables, dict):
        raise ConfigError("configs/tables.yaml must map table ids to tables")
    return tables
