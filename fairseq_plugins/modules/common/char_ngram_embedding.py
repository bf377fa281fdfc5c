"""Character features of words: JMT's character n-gram embeddings joined to the word embedding.

The Multi-Scale paper's "+ Char" rows take character-level features from JMT (Hashimoto et al.,
2017): a word is ``#BEGIN#`` + its characters + ``#END#``, its character n-grams (n = 2, 3, 4)
are looked up and averaged (the layout of JMT's released ``charNgram.txt``, keys such as
``3gram-#BEGIN#th``), and the average is concatenated to the word's embedding. The n-grams of
a word depend on its spelling only, so they are computed once per dictionary type from the same
binarized input: no second input is needed, and the hub's text goes through the same lookup.
Special symbols, ``<unk>`` and fairseq's padding symbols (``madeupword0000``...) have no
characters (a zero vector).
"""

from typing import Dict, List, Sequence

import torch
from torch import Tensor, nn

from .pretrained_embeddings import read_vectors

JMT_ORDERS = (2, 3, 4)


def char_ngrams(word: str, orders: Sequence[int] = JMT_ORDERS) -> List[str]:
    """JMT's n-gram keys of ``word``, e.g. ``2gram-#BEGIN#a``, ``2gram-a#END#`` for ``a``."""
    chars = ["#BEGIN#", *word, "#END#"]
    return [f"{n}gram-{''.join(chars[i:i + n])}" for n in orders for i in range(len(chars) - n + 1)]


class CharNgramWordEmbedding(nn.Module):
    """[word embedding; mean of the word's character n-gram embeddings]: an ``nn.Embedding``
    stand-in for the encoders (``embedding_dim``, ``padding_idx``, ``num_embeddings``)."""

    def __init__(self, word_embedding: nn.Embedding, dictionary, ngram_dim: int):
        super().__init__()
        self.word_embedding = word_embedding
        self.padding_idx, self.num_embeddings = word_embedding.padding_idx, word_embedding.num_embeddings
        self.embedding_dim = word_embedding.embedding_dim + ngram_dim
        specials = set(range(dictionary.nspecial)) | {dictionary.unk()} | {
            i for i, word in enumerate(dictionary.symbols) if word.startswith("madeupword")}
        index: Dict[str, int] = {}
        per_word = [[] if i in specials else [index.setdefault(g, len(index) + 1) for g in char_ngrams(word)]
                    for i, word in enumerate(dictionary.symbols)]
        self.ngrams = ["<none>", *index]  # row 0: the padding n-gram
        width = max(1, max(map(len, per_word)))
        table = torch.zeros(len(per_word), width, dtype=torch.long)
        for i, grams in enumerate(per_word):
            table[i, : len(grams)] = torch.tensor(grams, dtype=torch.long)
        self.register_buffer("word_ngrams", table, persistent=False)  # derived from the dictionary
        self.ngram_embedding = nn.Embedding(len(self.ngrams), ngram_dim, padding_idx=0)
        nn.init.normal_(self.ngram_embedding.weight, mean=0, std=ngram_dim ** -0.5)
        with torch.no_grad():
            self.ngram_embedding.weight[0].zero_()

    def load_ngram_vectors(self, path) -> int:
        """Start the n-gram embeddings from JMT's ``charNgram.txt`` (GloVe's text format); returns
        how many of the dictionary's n-grams the file has."""
        vectors = read_vectors(path, wanted=set(self.ngrams[1:]))
        width = next(iter(vectors.values())).numel() if vectors else self.ngram_embedding.embedding_dim
        if width != self.ngram_embedding.embedding_dim:
            raise ValueError(f"{path} has {width}-d vectors but --char-ngram-dim is "
                             f"{self.ngram_embedding.embedding_dim}")
        with torch.no_grad():
            for row, gram in enumerate(self.ngrams):
                if gram in vectors:
                    self.ngram_embedding.weight[row] = vectors[gram]
        return len(vectors)

    def forward(self, tokens: Tensor) -> Tensor:
        types, inverse = tokens.unique(return_inverse=True)  # each word type's n-grams averaged once
        grams = self.word_ngrams[types]
        counts = grams.ne(0).sum(1, keepdim=True).clamp_min(1)
        chars = self.ngram_embedding(grams).sum(1) / counts
        return torch.cat([self.word_embedding(tokens), chars[inverse]], -1)
