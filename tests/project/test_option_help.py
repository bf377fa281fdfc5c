"""Every option the plugin adds to fairseq's parsers (its models, tasks and criteria) has help in
plain words, as ``fairseq-train --help`` shows it: no reStructuredText markup."""

import argparse
import re

import pytest
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.models import MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY

import fairseq_plugins.models  # noqa: F401
import fairseq_plugins.tasks  # noqa: F401

RST = re.compile(r"``|:[a-z]+:`")
PLUGIN = sorted((kind, name) for kind, registry in (("model", MODEL_REGISTRY), ("task", TASK_REGISTRY),
                                                    ("criterion", CRITERION_REGISTRY))
                for name, cls in registry.items() if cls.__module__.startswith("fairseq_plugins"))
REGISTRIES = {"model": MODEL_REGISTRY, "task": TASK_REGISTRY, "criterion": CRITERION_REGISTRY}


def _options(cls) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    cls.add_args(parser)
    return {action.option_strings[0]: action.help for action in parser._actions if action.option_strings}


def _fairseq_base(cls):
    """The nearest fairseq class the plugin's class extends: the options it adds are fairseq's."""
    return next(base for base in cls.__mro__[1:] if base.__module__.startswith("fairseq."))


def _from_fairseq_config(cls, option: str) -> bool:
    """Whether the option is a field that a fairseq config class (which the plugin's extends) declares."""
    config = getattr(cls, "__dataclass", None) or getattr(cls, "config_class", None)
    name = option[2:].replace("-", "_")
    owners = [c for c in getattr(config, "__mro__", ()) if name in getattr(c, "__annotations__", {})]
    return bool(owners) and owners[-1].__module__.startswith("fairseq.")


def test_the_plugin_registers_models_tasks_and_criteria():
    assert {kind for kind, _ in PLUGIN} == {"model", "task", "criterion"}


@pytest.mark.parametrize("kind,name", PLUGIN)
def test_every_option_of_the_plugin_has_plain_help(kind, name):
    cls = REGISTRIES[kind][name]
    inherited = _options(_fairseq_base(cls))
    own = {option: text for option, text in _options(cls).items()
           if option not in inherited and not _from_fairseq_config(cls, option)}
    assert sorted(option for option, text in own.items() if not text or not text.strip()) == []
    assert {option: text for option, text in own.items() if RST.search(text)} == {}
