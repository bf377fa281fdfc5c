"""Text in and out of a character- or byte-level language model: ``--bpe code_points`` and
``--bpe byte_values`` (``bpe="code_points"`` in the hub's ``from_pretrained``).

fairseq applies a ``--bpe`` to every prompt before it is binarized and removes it from every
hypothesis: these turn a prompt's text into the data-bin's decimal tokens
(``fairseq_plugins.data.character_tokens``) and a sample's tokens back into text, line breaks
included (``fairseq-interactive`` prints it on its ``D-`` lines, ``sample()`` returns it).
"""

from dataclasses import dataclass

from fairseq.data.encoders import register_bpe
from fairseq.dataclass import FairseqDataclass

from fairseq_plugins.data import character_tokens


@dataclass
class CharacterTextConfig(FairseqDataclass):
    """No options: the unit is the name."""


class CharacterText:
    unit = ""

    def __init__(self, cfg=None):
        pass

    def encode(self, x: str) -> str:
        return character_tokens.encode(x, self.unit)

    def decode(self, x: str) -> str:
        return character_tokens.decode(x, self.unit)


@register_bpe("code_points", dataclass=CharacterTextConfig)
class CodePoints(CharacterText):
    """One token per Unicode character, its code point (``fairseq-plugins-prepare-data text``,
    text8, the LM study)."""

    unit = "characters"


@register_bpe("byte_values", dataclass=CharacterTextConfig)
class ByteValues(CharacterText):
    """One token per UTF-8 byte, its value (enwik8; ``text --unit bytes``)."""

    unit = "bytes"
