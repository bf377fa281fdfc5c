"""Model options declared once, as fairseq 0.12 dataclasses, for both of fairseq's entry points.

fairseq's own ``transformer`` declares its options in ``TransformerConfig``: ``add_args``
generates the command-line flags from it without defaults (so that ``--arch`` functions can set
them), and ``build_model`` turns whatever it is given (an argparse namespace from
``fairseq-train``, an OmegaConf node from ``fairseq-hydra-train``) into that dataclass. The
conversion keeps every declared field, but from an OmegaConf node it drops undeclared keys:
that is why options known only to ``add_args`` never reached a model under hydra.

Each plugin model therefore declares its options in a ``PluginTransformerConfig`` subclass,
generates its flags from it (``add_config_args``), fills unset options in its ``--arch``
functions from the dataclass defaults or the architecture's own values
(``set_default_options``), and converts with the subclass in ``build_model``.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Iterable, List

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.utils import safe_getattr
from fairseq.models.transformer import TransformerConfig

from fairseq_plugins.command_line import CommandError


@dataclass
class PluginTransformerConfig(TransformerConfig):
    """Base of the plugin models' configs. ``TransformerConfig`` stores every attribute named
    ``encoder_*``/``decoder_*`` in its ``encoder``/``decoder`` sub-config, where a field of
    the same name declared here would never see it (``--encoder-scales`` would read its
    default): fields declared by subclasses are stored as themselves."""

    def __setattr__(self, name, value):
        if name in _own_field_names(type(self)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


@functools.lru_cache(maxsize=None)
def _own_field_names(config_cls) -> frozenset:
    return frozenset(f.name for f in own_fields(config_cls))


def add_config_args(parser, config_cls) -> None:
    """The flags of every field of ``config_cls``, flat (``--encoder-embed-dim``), no defaults."""
    gen_parser_from_dataclass(parser, config_cls(), delete_default=True, with_prefix="")


def own_fields(config_cls) -> List[dataclasses.Field]:
    """The fields ``config_cls`` declares beyond fairseq's ``TransformerConfig``."""
    inherited = {f.name for f in dataclasses.fields(TransformerConfig)}
    return [f for f in dataclasses.fields(config_cls) if f.name not in inherited]


def _default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def set_default_options(args, config_cls, **arch_values) -> None:
    """Give every option of ``config_cls`` that is not set (absent or None) the architecture's
    value from ``arch_values``, else the dataclass default. Values that are set, including 0
    or an empty string, are left as they are: ``build_model`` validates them."""
    unknown = set(arch_values) - {f.name for f in own_fields(config_cls)}
    if unknown:
        raise TypeError(f"{config_cls.__name__} has no options {sorted(unknown)}")
    for field in own_fields(config_cls):
        if getattr(args, field.name, None) is None:
            setattr(args, field.name, arch_values.get(field.name, _default(field)))


class OptionError(CommandError, ValueError):
    """A model option's value no model can take; fairseq's commands print it in one line, without
    a traceback (``command_line.print_command_errors_in_one_line``)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_choice(cfg, name: str, choices: Iterable[str]) -> None:
    """The argparse path checks choices; a hydra config reaches the model unchecked."""
    choices = tuple(choices)
    value = getattr(cfg, name)
    if value not in choices:
        raise OptionError(f"{flag(name)} {value!r}: choose from {', '.join(choices)}")


def check_at_least(cfg, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise OptionError(f"{flag(name)} must be an integer >= {minimum}, got {value!r}")


def lm_max_positions(args, model: str) -> None:
    """Bound a language model's positions by ``--tokens-per-sample`` as ``transformer_lm`` does.
    fairseq's own LM config reads it from the task by interpolation; these models are
    registered with ``add_args``, so under fairseq-hydra-train the model section must say so."""
    if safe_getattr(args, "max_target_positions", None) is not None:
        return
    tokens_per_sample = safe_getattr(args, "tokens_per_sample", None)
    if tokens_per_sample is None:
        raise ValueError(f"{model} needs the context length: under fairseq-hydra-train put "
                         "`tokens_per_sample: ${task.tokens_per_sample}` in the model section "
                         "(configs/hydra/*_lm.yaml do)")
    args.max_target_positions = tokens_per_sample


def task_tokens_per_sample(task):
    """The context the task cuts its blocks to (``--tokens-per-sample``; fairseq-eval-lm has
    already taken ``--context-window`` off it), or None for a task without one."""
    options = getattr(task, "args", None) or getattr(task, "cfg", None)  # fairseq's LM task keeps args only
    return safe_getattr(options, "tokens_per_sample", None)


def check_lm_context(args, task, model: str) -> None:
    """A language model with absolute positions cannot score blocks longer than it was built
    for: fairseq-eval-lm would skip every block and print a loss of 0 over 0 tokens."""
    tokens = task_tokens_per_sample(task)
    if tokens is not None and tokens > args.max_target_positions:
        raise ValueError(f"--tokens-per-sample {tokens} is longer than the {args.max_target_positions} positions "
                         f"{model} was trained with (absolute positions): every block would be skipped and "
                         f"nothing scored; use --tokens-per-sample <= {args.max_target_positions}")


def config_with_options(name: str, base, source, names: Iterable[str], module: str):
    """A dataclass ``name`` deriving from ``base`` plus the options ``names`` as ``source``
    declares them (type, default, help): a model family with another fairseq base config
    (e.g. ``TransformerLanguageModelConfig``) shares the option definitions instead of copying them."""
    declared = {f.name: f for f in dataclasses.fields(source)}
    unknown = [n for n in names if n not in declared]
    if unknown:
        raise TypeError(f"{source.__name__} has no options {unknown}")
    fields = [(n, declared[n].type, dataclasses.field(default=_default(declared[n]), metadata=declared[n].metadata))
              for n in names]
    config_cls = dataclasses.make_dataclass(name, fields, bases=(base,))
    config_cls.__module__ = module
    return config_cls
