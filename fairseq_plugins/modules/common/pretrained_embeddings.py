"""Pre-trained word vectors (GloVe's text format) as a model's input embeddings.

GloVe files have one ``word v1 ... vd`` line per word and no header; word2vec's text format
adds a first ``count dim`` line, which is recognised and skipped. (fairseq's own
``utils.parse_embedding`` always skips the first line, so it loses GloVe's first word.)
Words of the dictionary that the file lacks keep their initialisation.
"""

from pathlib import Path
from typing import Dict

import torch
from torch import nn


def read_vectors(path, wanted=None) -> Dict[str, torch.Tensor]:
    """``word -> vector`` from a GloVe (or word2vec text) file; only ``wanted`` words if given."""
    vectors, dim = {}, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            fields = line.rstrip("\n").rstrip(" ").split(" ")
            if line_no == 1 and len(fields) == 2 and all(x.isdigit() for x in fields):
                continue  # word2vec header
            if len(fields) < 2:
                continue
            # a few GloVe releases (840B) hold words with spaces: the vector is the last dim fields
            width = dim or len(fields) - 1
            word = " ".join(fields[:-width])
            if len(fields) - 1 < width or not word:
                raise ValueError(f"{path}:{line_no}: expected a word and {width} numbers")
            if dim is None:
                dim = width
            if wanted is None or word in wanted:
                vectors[word] = torch.tensor([float(x) for x in fields[-width:]])
    if dim is None:
        raise ValueError(f"{path} holds no vectors")
    return vectors


def load_pretrained(embedding: nn.Embedding, dictionary, path) -> int:
    """Copy the vectors of ``path`` into ``embedding`` rows of the words of ``dictionary``;
    returns how many words were found. The file's width must equal the embedding's."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"word vectors {path} not found")
    vectors = read_vectors(path, wanted=set(dictionary.symbols))
    width = next(iter(vectors.values())).numel() if vectors else embedding.embedding_dim
    if width != embedding.embedding_dim:
        raise ValueError(f"{path} has {width}-d vectors but the embeddings are {embedding.embedding_dim}-d: "
                         f"set --encoder-embed-dim {width}")
    with torch.no_grad():
        for word, vector in vectors.items():
            embedding.weight[dictionary.index(word)] = vector
    return len(vectors)
