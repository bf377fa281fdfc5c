"""The schema of a paper-table file (``configs/<paper>/<table>.yaml``) as OmegaConf structured
configs: an unknown key, a value of the wrong type or a missing field is refused by OmegaConf,
and ``config.load_table`` turns its error into one line naming the file, the row and the key.

A table file::

    table: bpt-table4                # the table's id (fairseq-plugins-reproduce TABLE)
    title: 'BPT Table 4: ...'
    paper: bpt                       # bpt | segtree | multiscale | slowfast | project
    metric: bpc                      # the column's metric (config.METRICS: sacrebleu, tokenized, bpc, ppl, ...)
    columns: [Enwik8, Text8]
    base: [bpt/base/lm.yaml]         # shared settings files under configs/, merged first, in order
    defaults: {data: ..., arch: ..., gpus: 4, task: {...}, model: {...}, train: {...}}
    sources: {train.lr: 'paper: ...'}   # where each value comes from, by dotted key
    measure: flops                   # optional: rows measured in-process, not trained: flops (measure_flops.py),
                                     # or a figure's points (peak-memory, mirrored-summation, test-time: figures/)
    rows:
      - id: enwik8-l512              # the row's key: bpt-table4:enwik8-l512
        row: l = 512                 # the label the paper prints
        column: Enwik8
        reported: {bpc: 1.07}        # the paper's number
        task: {tokens-per-sample: 512}   # what differs from the defaults
        sources: {task.tokens-per-sample: 'paper: Table 4'}
      - {row: 'Transformer-XL', reported: {bpc: 0.99}, why: 'prior work, not rerun'}

A row's ``base: [bpt/base/imdb.yaml]`` merges those files over the table's defaults, under the row:
the settings of one column (IMDB's) in a table whose defaults are another's (SST-5's).

A row with ``sweep: {model.graph-k: [1, 2, 4]}`` stands for one row per value (several keys: every
combination); ``{model.graph-k}`` in its ``id``, ``row`` and ``column`` is replaced by the value.
Values that vary together are a list of cases, each with its own paper number::

    sweep:
      - {task.tokens-per-sample: 512, model.graph-rel-clip: 2, reported: {bpc: 1.07}}
      - {task.tokens-per-sample: 1024, model.graph-rel-clip: 3, reported: {bpc: 1.05}}
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

PAPERS = ("bpt", "segtree", "multiscale", "slowfast", "project")
SECTIONS = ("task", "model", "train", "generate", "evaluate")  # fairseq options, by command
SETTINGS = ("data", "arch", "gpus", "average_last", "seeds", "sacrebleu_tokenize")  # the rest a row sets


@dataclass
class Settings:
    """What the defaults, a base file or a row sets: the corpus, the model and every option."""

    data: Optional[str] = None  # corpus of fairseq-plugins-prepare-data
    arch: Optional[str] = None
    gpus: Optional[int] = None  # GPUs the paper's batch assumes; --update-freq keeps it on fewer
    average_last: Optional[int] = None  # average the last N epoch checkpoints (0: checkpoint_best)
    seeds: Optional[int] = None  # the paper's protocol: N runs (fairseq seeds 1..N), mean and deviation
    sacrebleu_tokenize: Optional[str] = None  # sacrebleu's tokenizer of the detokenized score
    task: Dict[str, Any] = field(default_factory=dict)  # task options: training and evaluation
    model: Dict[str, Any] = field(default_factory=dict)
    train: Dict[str, Any] = field(default_factory=dict)
    generate: Dict[str, Any] = field(default_factory=dict)  # fairseq-generate (translation)
    evaluate: Dict[str, Any] = field(default_factory=dict)  # the other tasks' evaluation


@dataclass
class Row(Settings):
    row: str = MISSING  # the label the paper prints
    base: List[str] = field(default_factory=list)  # settings files merged over the table's defaults, under the row
    id: Optional[str] = None  # the row's key in the table (required for rows that run)
    column: Optional[str] = None  # default: the table's only column
    reported: Dict[str, float] = field(default_factory=dict)  # the paper's numbers, by metric or column
    why: Optional[str] = None  # set: a row reported by the paper and not rerun, and why
    sweep: Any = None  # {dotted key: [values]} (every combination) or [{dotted key: value, reported: {...}}]
    sources: Dict[str, str] = field(default_factory=dict)
    note: Optional[str] = None


@dataclass
class BaseFile:
    """A shared settings file, named by the ``base:`` of tables or of other base files."""

    base: List[str] = field(default_factory=list)
    defaults: Settings = field(default_factory=Settings)
    sources: Dict[str, str] = field(default_factory=dict)
    note: Optional[str] = None


@dataclass
class TableFile(BaseFile):
    table: str = MISSING
    title: str = MISSING
    paper: str = MISSING
    metric: str = MISSING
    measure: Optional[str] = None  # set: rows are measured in-process (config.MEASURES), not trained
    extra_metrics: List[str] = field(default_factory=list)
    columns: List[str] = field(default_factory=lambda: ["BLEU"])
    rows: List[Row] = field(default_factory=list)
