"""Raw text with sentence separators through fairseq's tokenizers and BPE.

Document-level input joins the context sentences and the current sentence with ``<s>``
(``context sentence <s> current sentence``, see ``document_layout``). Every tokenizer and BPE
fairseq offers rewrites that marker (moses splits it into ``< s >``, sentencepiece into pieces),
which would fuse the context into the sentence. ``SentenceSeparated`` wraps one of them so that
the text is split on the marker first, each sentence is encoded alone, and the parts are joined
again by the marker as a token of its own.
"""


class SentenceSeparated:
    """A fairseq tokenizer or BPE (``encode``/``decode``) applied to each sentence of a line,
    sentences separated by ``separator`` (the dictionary's ``<s>``); everything else is the
    wrapped object's."""

    def __init__(self, inner, separator: str):
        self.inner = inner
        self.separator = separator

    def encode(self, line: str) -> str:
        return f" {self.separator} ".join(self.inner.encode(part) for part in self._sentences(line))

    def decode(self, line: str) -> str:
        return f" {self.separator} ".join(self.inner.decode(part) for part in self._sentences(line))

    def _sentences(self, line: str):
        """The non-empty sentences of a line, stripped (a stray leading or doubled marker adds none)."""
        parts = [part.strip() for part in line.split(self.separator)]
        return [part for part in parts if part] or [""]

    def __getattr__(self, name):  # is_beginning_of_word and the like
        if name == "inner":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

