"""A fingerprint of a model's dictionaries, saved in its checkpoints and checked when they load.

fairseq loads a checkpoint against any dictionary of the right size. With a data-bin whose
dictionary holds the same words in another order, every embedding row then belongs to another
word: the model translates garbage and nothing says why (REFERENCE.md section 8). The same
holds for a classifier's label dictionary (``label/dict.txt``): labels binarized in another
order swap the classes. A plugin model keeps one int64 per dictionary (source, target, and a
classifier's or tagger's labels) in a buffer, saved with its parameters; loading compares it
with the dictionaries of the task at hand and refuses a mismatch.

Checkpoints written before the fingerprint existed load as before: there is nothing to compare;
a classifier's written before its labels were fingerprinted are checked on source and target.
Setting ``FAIRSEQ_PLUGINS_ALLOW_DICTIONARY_MISMATCH=1`` loads a checkpoint against other
dictionaries on purpose (e.g. fine-tuning after re-indexing); the new fingerprint is then kept.
"""

import hashlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

BUFFER = "dictionary_fingerprint"
OVERRIDE = "FAIRSEQ_PLUGINS_ALLOW_DICTIONARY_MISMATCH"


class DictionaryMismatchError(RuntimeError):
    """A checkpoint met dictionaries other than those it was trained with."""


def fingerprint(dictionary) -> int:
    """A signed 64-bit hash of the dictionary's symbols in index order (counts do not matter)."""
    digest = hashlib.sha256("\n".join(dictionary.symbols).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class DictionaryFingerprint:
    """Mixin for a fairseq model (encoder-decoder or language model), listed before it in the bases."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer(BUFFER, self._current_fingerprint())

    def fingerprinted_dictionaries(self) -> dict:
        """{"source": ..., "target": ...} dictionaries, in this order; a language model has only its
        decoder's, which is both (an encoder-only model overrides this, and adds its labels)."""
        encoder = getattr(self, "encoder", None)
        source = self.decoder if encoder is None else encoder
        return {"source": source.dictionary, "target": self.decoder.dictionary}

    def _current_fingerprint(self) -> torch.Tensor:
        return torch.tensor([fingerprint(d) for d in self.fingerprinted_dictionaries().values()])

    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq calls this on every checkpoint before loading it: check, or fill in for old ones."""
        super().upgrade_state_dict_named(state_dict, name)
        key = f"{name}.{BUFFER}" if name else BUFFER
        current = self._current_fingerprint()
        saved = state_dict.get(key)
        dictionaries = self.fingerprinted_dictionaries()
        # zip: a checkpoint from before the labels were fingerprinted is checked on what it has
        sides = [side for side, a, b in zip(dictionaries, saved.tolist(), current.tolist()) if a != b] \
            if saved is not None else []
        if sides:
            harm = ("labels would be swapped and the predicted classes wrong" if sides == ["label"] else
                    "symbols would map to the wrong embeddings and rows, and the output would be garbage")
            message = (
                f"the checkpoint was trained with another {' and '.join(sides)} dictionary than the one "
                f"loaded now ({', '.join(f'{s}: {len(dictionaries[s])} symbols' for s in sides)}); {harm}. Use "
                f"the data-bin (dict*.txt, label/dict.txt) the model was trained with, or set {OVERRIDE}=1 to load "
                "it anyway."
            )
            if os.environ.get(OVERRIDE) != "1":
                raise DictionaryMismatchError(message)
            logger.warning(f"{OVERRIDE}=1: loading anyway; {message}")
        state_dict[key] = current
