"""What every plugin model adds to fairseq's TransformerModel; it comes first in the model's bases."""

from fairseq_plugins.models.dictionary_fingerprint import DictionaryFingerprint


class PluginModel(DictionaryFingerprint):
    """Checkpoints bound to their dictionaries, and no inherited download list."""

    @classmethod
    def hub_models(cls):
        """None to download: TransformerModel's list names the stock transformer's WMT checkpoints,
        which a plugin architecture cannot load. ``from_pretrained`` takes a local folder."""
        return {}
