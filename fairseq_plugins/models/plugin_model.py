"""What every plugin model adds to fairseq's TransformerModel; it comes first in the model's bases."""

from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.utils import split_paths

from fairseq_plugins.data.labels import check_no_empty_split
from fairseq_plugins.models.dictionary_fingerprint import DictionaryFingerprint


def task_data_folders(task):
    """The data-bin folders of a task (fairseq's ``data``, shards separated by ':'), or none."""
    options = getattr(task, "cfg", None) or getattr(task, "args", None)  # fairseq's LM task keeps args only
    data = getattr(options, "data", None)
    return split_paths(data) if isinstance(data, str) and data else []


class PluginModel(DictionaryFingerprint):
    """Checkpoints bound to their dictionaries and to their kind of task, and no inherited
    download list."""

    language_model = False  # a decoder alone, for --task language_modeling

    @classmethod
    def build_model(cls, args, task):
        cls.check_task(args, task)
        return super().build_model(args, task)

    @classmethod
    def check_task(cls, args, task) -> None:
        """A language model under a translation task, or a translation model under the
        language-modelling one (a checkpoint given to the other kind of command), otherwise fails
        later on an attribute or a dictionary that says nothing of the cause; an empty split of
        the task's data, which fairseq could not open."""
        for folder in task_data_folders(task):
            check_no_empty_split(folder)
        if isinstance(task, LanguageModelingTask) == cls.language_model:
            return
        arch = getattr(args, "arch", cls.__name__)
        if cls.language_model:
            raise ValueError(f"{arch} is a language model, not a translation model: give fairseq-generate or "
                             f"fairseq-interactive --task language_modeling, or score it with fairseq-eval-lm")
        raise ValueError(f"{arch} is a translation model, not a language model: score it with fairseq-generate "
                         f"(its translation task), not with fairseq-eval-lm or --task language_modeling")

    @classmethod
    def hub_models(cls):
        """None to download: TransformerModel's list names the stock transformer's WMT checkpoints,
        which a plugin architecture cannot load. ``from_pretrained`` takes a local folder."""
        return {}
