"""Characters and word boundaries derived from src_tokens (TranSFormer's fast-branch input)."""

import pytest
import torch

from fairseq.data import Dictionary
from fairseq_plugins.modules.slowfast.subword_characters import (
    UNK_CHAR,
    WORD_END_CHAR,
    SubwordCharacterTable,
    detect_subword_style,
)


def _dictionary(symbols):
    d = Dictionary()
    for s in symbols:
        d.add_symbol(s)
    return d


def _encode(d, sentences, left_pad=True):
    rows = [[d.index(w) for w in s.split()] + [d.eos()] for s in sentences]
    width = max(len(r) for r in rows)
    pad = [[d.pad()] * (width - len(r)) for r in rows]
    return torch.tensor([p + r if left_pad else r + p for p, r in zip(pad, rows)])


BPE = ["A", "swi@@", "ss", "bicy@@", "cle", "a", "b@@", "c", "x", "_"]
SPM = ["\u2581A", "\u2581swi", "ss", "\u2581bicy", "cle", "\u2581a", "\u2581b", "c", "\u2581x", "\u2581"]


@pytest.mark.parametrize(
    "symbols, sentence", [(BPE, "A swi@@ ss bicy@@ cle"), (SPM, "\u2581A \u2581swi ss \u2581bicy cle")]
)
def test_paper_example_for_both_subword_styles(symbols, sentence):
    d = _dictionary(symbols)
    table = SubwordCharacterTable(d)
    fast = table(_encode(d, [sentence]))
    # "_" after every word; </s> is the first non-pad special symbol (<#1> after <s>)
    assert table.decode(fast, 0) == "A _ s w i s s _ b i c y c l e _ <#1>"
    assert fast.word_ids[0].tolist() == [0, 0] + [1] * 6 + [2] * 8 + [3]
    # subword positions: A=0, swi=1, ss=2, bicy=3, cle=4, </s>=5
    assert fast.subword_ids[0].tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5]
    assert fast.subword_word_ids[0].tolist() == [0, 1, 1, 2, 2, 3]


def test_style_detection():
    assert detect_subword_style(BPE) == "bpe"
    assert detect_subword_style(SPM) == "sentencepiece"
    assert detect_subword_style(["the", "dog"]) == "bpe"  # word level: every token is a word
    assert SubwordCharacterTable(_dictionary(SPM), style="bpe").style == "bpe"
    with pytest.raises(ValueError, match="subword style"):
        SubwordCharacterTable(_dictionary(BPE), style="wordpiece")


@pytest.mark.parametrize("symbols, sentence", [(BPE, "a b@@ c x"), (SPM, "\u2581a \u2581b c \u2581x")])
def test_single_character_words_and_literal_underscore(symbols, sentence):
    d = _dictionary(symbols)
    table = SubwordCharacterTable(d)
    fast = table(_encode(d, [sentence]))
    assert table.decode(fast, 0) == "a _ b c _ x _ <#1>"
    assert fast.word_ids[0].tolist() == [0, 0, 1, 1, 1, 2, 2, 3]


def test_literal_underscore_is_not_the_word_end_marker():
    d = _dictionary(BPE)
    fast = SubwordCharacterTable(d)(_encode(d, ["_"]))
    literal, marker, _eos = fast.tokens[0].tolist()
    assert marker == WORD_END_CHAR and literal not in (WORD_END_CHAR, UNK_CHAR)


def test_unknown_characters_and_unk_token():
    d = _dictionary(["aaa", "ab", "zq"])
    d.count[d.index("aaa")] = 50
    table = SubwordCharacterTable(d, max_characters=2)  # keeps a, b; z and q are unknown
    assert table.character_vocabulary() == ["a", "b"]
    src = torch.tensor([[d.index("zq"), d.unk(), d.index("ab"), d.eos()]])
    assert table.decode(table(src), 0) == "<?> <?> _ <?> a b _ <#1>"
    with pytest.raises(ValueError, match="max_characters"):
        SubwordCharacterTable(d, max_characters=0)


def test_padding_side_and_batching_do_not_change_a_sentence():
    d = _dictionary(BPE)
    table = SubwordCharacterTable(d)
    sentences = ["a b@@ c x", "A swi@@ ss bicy@@ cle", "x"]
    alone = [table(_encode(d, [s])) for s in sentences]
    for left_pad in (True, False):
        batch = table(_encode(d, sentences, left_pad=left_pad))
        for i, single in enumerate(alone):
            n = int((~single.padding_mask[0]).sum())
            assert int((~batch.padding_mask[i]).sum()) == n
            assert torch.equal(batch.tokens[i, :n], single.tokens[0])
            assert torch.equal(batch.word_ids[i, :n], single.word_ids[0])
            assert (batch.word_ids[i, n:] == -1).all() and (batch.subword_ids[i, n:] == -1).all()
            shift = batch.subword_word_ids.size(1) - single.subword_word_ids.size(1) if left_pad else 0
            assert torch.equal(batch.subword_ids[i, :n] - shift, single.subword_ids[0])


def test_truncated_subword_before_eos_still_ends_its_word():
    d = _dictionary(BPE)
    table = SubwordCharacterTable(d)
    fast = table(_encode(d, ["x swi@@"]))
    assert table.decode(fast, 0) == "x _ s w i _ <#1>"


def test_table_lives_in_the_state_dict_and_refuses_another_dictionary():
    d = _dictionary(BPE)
    table = SubwordCharacterTable(d)
    state = table.state_dict()
    assert {"token_chars", "character_codepoints", "token_open_end", "token_open_start"} <= set(state)
    assert "".join(map(chr, state["character_codepoints"].tolist())) == "".join(table.character_vocabulary())
    other = SubwordCharacterTable(_dictionary(BPE + ["longer_subword@@"]))
    with pytest.raises(RuntimeError, match="size mismatch"):
        other.load_state_dict(state)


def test_bad_token_ids_are_refused():
    table = SubwordCharacterTable(_dictionary(BPE))
    with pytest.raises(ValueError, match="outside"):
        table(torch.tensor([[len(BPE) + 10]]))
    with pytest.raises(ValueError, match="B x T"):
        table(torch.tensor([4, 5]))


def test_subword_input_keeps_the_subwords():
    d = _dictionary(BPE)
    table = SubwordCharacterTable(d)
    src = _encode(d, ["x", "A swi@@ ss"])
    fast = table.subword_input(src)
    assert torch.equal(fast.tokens, src)
    assert fast.word_ids[1].tolist() == [0, 1, 1, 2]
    assert fast.word_ids[0].tolist() == [-1, -1, 0, 1]
