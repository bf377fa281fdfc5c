"""Experiment configs: one file per paper table (``configs/<paper>/<table>.yaml``, the schema in
``table_schema``), each row an experiment that trains one model and scores it.

A row is named ``TABLE:ROW`` (``bpt-table4:enwik8-l512``): the table's id, or the path of a table
file, and the row's id. Resolving a row merges, in order, the table's ``base:`` files (recursively),
the table's ``defaults``, the row's own ``base:`` files (the settings of one column that several tables
share: IMDB's over SST-5's), the row and its sweep value; its sources merge the same way, and every value
that is set must have one: ``paper: <section, table or equation>``, ``original: <owner>/<repo>@<commit>
<file>`` or ``ours: <why>``.

A resolved row is a dict::

    name: bpt-table4/enwik8-l512   # table/row: results/<name>.json, and run logs
    paper, table, id, row, column, reported, note
    data, arch, gpus, average_last, seeds?, sacrebleu_tokenize?
    task, model, train, generate, evaluate: {option: value}
    sources: {dotted key: source}

Options are fairseq command-line flags without the leading ``--``: ``true`` is a bare flag,
``false``/``null`` leave the flag out, anything else is its value.
"""

import copy
import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..resources import resource_dir, user_dir
from .table_schema import PAPERS, SECTIONS, SETTINGS, BaseFile, Row, TableFile

CONFIG_DIR = resource_dir("configs")
USER_DIR = user_dir()
# what ``reported`` may hold; the last four are the measured figures' (peak MiB of a step, test MSE, ms per batch)
# and Multi-Scale Figure 3's (percentage of attention edges)
METRICS = ("sacrebleu", "tokenized", "bpc", "ppl", "accuracy", "f1", "gflops", "peak_mib", "mse", "ms", "percent")
# a table's rows trained and evaluated (None), or measured in-process: a fairseq model's FLOPs
# (measure_flops), or the points of a paper's measured figure (recipes/figures/)
MEASURES = (None, "flops", "peak-memory", "mirrored-summation", "test-time")
FIGURES = MEASURES[2:]  # their rows name the figure's model in ``evaluate``: no corpus, arch or GPU count
SACREBLEU_TOKENIZERS = ("13a", "intl", "zh", "char", "none")
# flags the scripts set themselves; a config must not carry them
_RESERVED = {"user-dir", "arch", "save-dir", "path", "distributed-world-size", "gen-subset", "remove-bpe",
             "results-path", "cpu", "fp16", "bf16"}
_REQUIRED = ("data", "arch", "gpus", "average_last")
_SOURCE = re.compile(r"(paper: \S.*|original: [\w.-]+/[\w.-]+@[0-9a-f]{7,40} \S.*|ours: \S.*)", re.S)
_ROW_ID = re.compile(r"[a-z0-9][a-z0-9._+-]*")
_TEMPLATE = re.compile(r"\{([^{}]+)\}")
NOT_TABLES = ("hydra",)  # configs/ folders of other configs (fairseq-hydra-train's)


class ConfigError(ValueError):
    pass


def table_files() -> List[Path]:
    """Every paper-table file: ``configs/<paper>/*.yaml`` (base files sit in ``<paper>/base/``)."""
    return sorted(p for p in CONFIG_DIR.glob("*/*.yaml") if p.parent.name not in NOT_TABLES)


def _checked(raw: Dict[str, Any], schema, where: str) -> Dict[str, Any]:
    """``raw`` against a structured config: plain containers, or one line naming the key."""
    try:
        return OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), raw), throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or "?"
        raise ConfigError(f"{where}: key {key}: {str(err).splitlines()[0]}") from err


def _read(path: Path, schema, where: str) -> Dict[str, Any]:
    """One YAML file checked against its schema; a table's rows each on their own, so that an error
    names the row."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{where}: cannot read: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    rows = raw.pop("rows", [])
    spec = _checked(raw, schema, where)
    if schema is TableFile:
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{where}: key rows: a list of mappings, one per row")
        spec["rows"] = [_checked(r, Row, f"{where}: row {r.get('id') or r.get('row') or i!r}")
                        for i, r in enumerate(rows)]
    elif rows:
        raise ConfigError(f"{where}: key rows: a base file holds no rows")
    return spec


def _base_path(name: str, where: str) -> Path:
    path = CONFIG_DIR / name
    if not path.is_file():
        raise ConfigError(f"{where}: base {name!r} is no file under {CONFIG_DIR}")
    return path


def _merge(into: Dict[str, Any], settings: Dict[str, Any]) -> None:
    """Settings over settings: sections merge option by option, the rest is replaced; None is unset."""
    for key in SETTINGS:
        if settings.get(key) is not None:
            into[key] = settings[key]
    for section in SECTIONS:
        into.setdefault(section, {}).update(settings.get(section) or {})


def _layers(spec: Dict[str, Any], where: str, seen: Tuple[str, ...] = ()) -> Iterator[Tuple[Dict, Dict, str]]:
    """(defaults, sources, file) of the base files of ``spec``, deepest first, then its own."""
    for name in spec.get("base") or []:
        if name in seen:
            raise ConfigError(f"{where}: base files name each other in a cycle: {' -> '.join(seen + (name,))}")
        base = _read(_base_path(name, where), BaseFile, f"{where}: base {name}")
        yield from _layers(base, f"configs/{name}", seen + (name,))
    yield spec.get("defaults") or {}, spec.get("sources") or {}, where


def flatten(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The values a resolved row sets, by dotted key (``train.lr``); unset ones left out."""
    flat = {key: cfg[key] for key in SETTINGS if cfg.get(key) is not None}
    for section in SECTIONS:
        flat.update({f"{section}.{k}": v for k, v in (cfg.get(section) or {}).items() if v is not None})
    return flat


def _set_dotted(cfg: Dict[str, Any], key: str, value: Any, where: str) -> None:
    head, _, option = key.partition(".")
    if head in SECTIONS and option:
        cfg.setdefault(head, {})[option] = value
    elif head in SETTINGS and not option:
        cfg[head] = value
    else:
        raise ConfigError(f"{where}: sweep key {key!r} is neither a setting ({', '.join(SETTINGS)}) nor "
                          f"section.option ({', '.join(SECTIONS)})")


def _fill(template: Optional[str], flat: Dict[str, Any], where: str) -> Optional[str]:
    """``'BPT (k = {model.graph-k})'`` with the row's values."""
    if template is None:
        return None

    def value(match):
        if match.group(1) not in flat:
            raise ConfigError(f"{where}: {{{match.group(1)}}} in {template!r} names no value of the row")
        return str(flat[match.group(1)])

    return _TEMPLATE.sub(value, template)


def _sweep(row: Dict[str, Any], where: str) -> List[Tuple[Dict[str, Any], Dict[str, float]]]:
    """The rows a sweep stands for, as ({dotted key: value}, the paper's numbers): every combination of
    ``{key: [values]}``, or each case of ``[{key: value, ..., reported: {...}}]`` (values that vary
    together, each case with its own number)."""
    sweep = row.get("sweep")
    if not sweep:
        return [({}, row["reported"])]
    if isinstance(sweep, dict):
        combos: List[Dict[str, Any]] = [{}]
        for key, values in sweep.items():
            if not isinstance(values, list):
                raise ConfigError(f"{where}: sweep {key!r} must list its values")
            combos = [dict(c, **{key: v}) for c in combos for v in values]
        return [(combo, row["reported"]) for combo in combos]
    if not isinstance(sweep, list) or not all(isinstance(case, dict) for case in sweep):
        raise ConfigError(f"{where}: a sweep is {{key: [values]}} or a list of cases {{key: value, reported: ...}}")
    cases = []
    for case in sweep:
        case = dict(case)
        reported = {**row["reported"], **(case.pop("reported", None) or {})}
        cases.append((case, reported))
    return cases


def _check_row(cfg: Dict[str, Any], where: str) -> None:
    for key in () if cfg["measure"] in FIGURES else _REQUIRED:
        if cfg.get(key) is None:
            raise ConfigError(f"{where}: missing '{key}' (set it in the row, the defaults or a base file)")
    for metric in cfg["reported"]:
        if metric not in METRICS:
            raise ConfigError(f"{where}: reported must map metrics {METRICS} to numbers, got {metric!r}")
    for section in SECTIONS:
        clash = _RESERVED.intersection(cfg[section])
        if clash:
            raise ConfigError(f"{where}: '{section}' sets {sorted(clash)}, which the scripts set themselves")
    if cfg.get("sacrebleu_tokenize", "13a") not in SACREBLEU_TOKENIZERS:
        raise ConfigError(f"{where}: sacrebleu_tokenize must be one of {SACREBLEU_TOKENIZERS}")
    if (cfg.get("seeds") or 1) < 1 or "seed" in cfg["train"] and cfg.get("seeds"):
        raise ConfigError(f"{where}: seeds must be >= 1, and a row with seeds sets no train seed")
    if cfg.get("gpus", 1) < 1 or cfg.get("average_last", 0) < 0:
        raise ConfigError(f"{where}: gpus must be >= 1 and average_last >= 0")
    for key, value in flatten(cfg).items():
        source = cfg["sources"].get(key)
        if source is None:
            raise ConfigError(f"{where}: {key} = {value!r} has no source (paper, original or ours)")
        if not _SOURCE.fullmatch(source):
            raise ConfigError(f"{where}: the source of {key} must read 'paper: <where>', "
                              f"'original: <owner>/<repo>@<commit> <file>' or 'ours: <why>', got {source!r}")


def _resolve_table(path: Path) -> Dict[str, Any]:
    """A table file's spec and its rows, resolved and checked."""
    where = str(path)
    spec = _read(path, TableFile, where)
    if spec["paper"] not in PAPERS:
        raise ConfigError(f"{where}: paper must be one of {PAPERS}, got {spec['paper']!r}")
    for metric in (spec["metric"], *spec["extra_metrics"]):
        if metric not in METRICS:
            raise ConfigError(f"{where}: metric {metric!r} is not one of {METRICS}")
    if spec["measure"] not in MEASURES:
        raise ConfigError(f"{where}: measure must be one of {[m for m in MEASURES if m]}, got {spec['measure']!r}")
    common: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for defaults, layer_sources, _ in _layers(spec, where):
        _merge(common, defaults)
        sources.update(layer_sources)
    rows, order, used = [], [], set()
    for raw in spec["rows"]:
        label = raw.get("id") or raw["row"]
        if raw.get("why") is not None:  # reported by the paper, not rerun
            order.append({"row": raw["row"], "reported": raw["reported"], "why": raw["why"]})
            continue
        if not raw.get("id"):
            raise ConfigError(f"{where}: row {raw['row']!r} needs an id (or a why: it is not rerun)")
        row_common, row_sources = copy.deepcopy(common), dict(sources)
        for defaults, layer_sources, _ in _layers({"base": raw["base"]}, f"{where}: row {label!r}"):
            _merge(row_common, defaults)
            row_sources.update(layer_sources)
        for combo, reported in _sweep(raw, f"{where}: row {label!r}"):
            cfg = copy.deepcopy(row_common)
            _merge(cfg, raw)
            row_where = f"{where}: row {label!r}"
            for key, value in combo.items():
                _set_dotted(cfg, key, value, row_where)
            for section in SECTIONS:  # null unsets an option of the defaults
                cfg[section] = {k: v for k, v in cfg[section].items() if v is not None}
            flat = flatten(cfg)
            row_id = _fill(raw["id"], flat, row_where)
            if not _ROW_ID.fullmatch(row_id):
                raise ConfigError(f"{row_where}: id {row_id!r} must be lower case letters, digits and ._+-")
            cfg.update(paper=spec["paper"], table=spec["table"], measure=spec["measure"], id=row_id,
                       name=f"{spec['table']}/{row_id}",
                       row=_fill(raw["row"], flat, row_where),
                       column=_fill(raw.get("column"), flat, row_where) or spec["columns"][0],
                       reported=reported, note=raw.get("note") or spec.get("note"),
                       sources={**row_sources, **raw["sources"]})
            row_where = f"{where}: row {row_id!r}"
            if cfg["column"] not in spec["columns"]:
                raise ConfigError(f"{row_where}: column {cfg['column']!r} is not one of {spec['columns']}")
            if any(r["id"] == row_id for r in rows):
                raise ConfigError(f"{row_where}: two rows have this id")
            _check_row(cfg, row_where)
            used.update(flat)
            rows.append(cfg)
            if cfg["row"] not in order:
                order.append(cfg["row"])
    for source_key in set(sources).union(*(r["sources"] for r in rows)) - used:
        raise ConfigError(f"{where}: a source for {source_key}, which no row sets")
    return {"table": spec["table"], "file": path, "title": spec["title"], "metric": spec["metric"],
            "measure": spec["measure"], "extra_metrics": spec["extra_metrics"], "columns": spec["columns"],
            "rows": order, "configs": rows}


def load_tables() -> Dict[str, Dict[str, Any]]:
    """Every shipped table by id: title, metric, columns, ``rows`` (labels in order; rows the paper
    reports and we do not rerun as {row, reported, why}) and ``configs`` (its resolved rows)."""
    return {table_id: _resolve_table(path) for table_id, path in sorted(table_ids().items())}


def load_table(table: str) -> Dict[str, Any]:
    """One table: a shipped table's id (``bpt-table4``) or the path of a table file."""
    if table.endswith(".yaml") or Path(table).is_file():
        path = Path(table)
        if not path.is_file():
            shipped = CONFIG_DIR / Path(*path.parts[1:]) if path.parts[:1] == ("configs",) else None
            if shipped is None or not shipped.is_file():
                raise ConfigError(f"{table}: no such table file")
            path = shipped
        return _resolve_table(path)
    by_id = table_ids()
    if table not in by_id:
        raise ConfigError(f"unknown table {table!r}; known: {', '.join(sorted(by_id))}")
    return _resolve_table(by_id[table])


def table_ids() -> Dict[str, Path]:
    """Every shipped table's id and file, read without resolving the tables."""
    by_id: Dict[str, Path] = {}
    for path in table_files():
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        table = spec.get("table") if isinstance(spec, dict) else None
        if not isinstance(table, str):
            raise ConfigError(f"{path}: key table: the table's id is missing")
        if table in by_id:
            raise ConfigError(f"{path}: table {table} is also {by_id[table]}")
        by_id[table] = path
    return by_id


def load_config(ref: str) -> Dict[str, Any]:
    """One resolved row: ``TABLE:ROW`` (``bpt-table4:enwik8-l512``, ``my_table.yaml:big``); a table
    of one row may be named alone."""
    table_ref, _, row_id = str(ref).rpartition(":") if ":" in str(ref) else (str(ref), "", "")
    table = load_table(table_ref)
    if not row_id:
        if len(table["configs"]) != 1:
            raise ConfigError(f"{ref}: name a row, TABLE:ROW; rows: {', '.join(c['id'] for c in table['configs'])}")
        return table["configs"][0]
    for cfg in table["configs"]:
        if cfg["id"] == row_id:
            return cfg
    raise ConfigError(f"{ref}: {table['table']} has no row {row_id!r}; rows: "
                      f"{', '.join(c['id'] for c in table['configs'])}")


def all_configs() -> List[Dict[str, Any]]:
    """Every row of every shipped table, resolved."""
    return [cfg for table in load_tables().values() for cfg in table["configs"]]


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


