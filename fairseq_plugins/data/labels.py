"""Checks of binarized data before training reads it: labels (a classifier's ``label/``, a
tagger's tags), which fairseq finds bad only when a batch holding one reaches the loss, after a
whole epoch (``IndexError: Target -1``, ``Target 3 is out of bounds``), and empty splits, which
it cannot open at all.

fairseq-train builds the model before it loads any data, so the models' ``build_model`` is
where the plugin sees the data first."""

import os
from typing import List


def class_labels(dictionary) -> List[str]:
    """The labels of a label dictionary: its symbols less fairseq's specials, the padding that
    fairseq-preprocess adds (``madeupword0000``, ...) and the ``<mask>`` sentence_prediction adds."""
    return [s for s in dictionary.symbols[dictionary.nspecial:] if not s.startswith("madeupword") and s != "<mask>"]


def check_num_classes(dictionary, num_classes: int, dictionary_path: str) -> None:
    """Every label's index (its place in the dictionary) must be below ``--num-classes``."""
    labels = class_labels(dictionary)
    if len(labels) > num_classes:
        raise ValueError(f"{dictionary_path} has {len(labels)} labels ({', '.join(labels[:10])}) but --num-classes is "
                         f"{num_classes}: the last would be out of range of the head; set --num-classes {len(labels)}")


def check_known(dataset, dictionary, path: str) -> None:
    """No line of a binarized label or tag file may hold <unk>: a label missing from the dictionary
    (fairseq-preprocess builds it from train alone) would be a target of -1."""
    unk = dictionary.unk()
    for line in range(len(dataset)):
        if (dataset[line] == unk).any():
            raise ValueError(f"{path}: line {line + 1} has a label that is not in {os.path.dirname(path)}/dict.txt "
                             "(read as <unk>): binarize every split's labels with one dictionary that holds them "
                             "all (fairseq-plugins-prepare-data does)")


def check_empty(path: str) -> None:
    """An empty split binarizes to an empty .bin, which fairseq cannot open ("cannot mmap an empty file")."""
    if os.path.exists(path + ".bin") and os.path.getsize(path + ".bin") == 0:
        raise ValueError(f"{path}.bin is empty: its split has no lines")


def check_no_empty_split(folder: str) -> None:
    """``check_empty`` for every binarized file of a data-bin and of its subfolders (a classifier's
    input0/, label/): run before fairseq-train loads any of them."""
    if not os.path.isdir(folder):
        return
    for root in [folder] + sorted(e.path for e in os.scandir(folder) if e.is_dir()):
        for name in sorted(os.listdir(root)):
            if name.endswith(".bin"):
                check_empty(os.path.join(root, name[:-len(".bin")]))


def check_regression_targets(folder: str) -> None:
    """sentence_prediction's regression targets are text (``label/{split}.label``, numbers a line),
    read with ``float`` when a split loads: a word there fails with no file or line."""
    if not os.path.isdir(folder):
        return
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".label")):
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                for value in line.split():
                    try:
                        float(value)
                    except ValueError:
                        raise ValueError(f"{path}:{number}: the regression target {value!r} is not a number") from None
