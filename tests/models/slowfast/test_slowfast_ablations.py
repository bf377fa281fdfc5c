"""The fast-branch ablations that need modules of their own: Linformer self-attention
(Table 5 #6) and the source re-segmented by a sentencepiece model (Table 4d)."""

import io

import pytest
import sentencepiece
import torch

from fairseq.data import Dictionary
from fairseq_plugins.modules.slowfast.linear_self_attention import LinformerSelfAttention
from fairseq_plugins.modules.slowfast.sentencepiece_fast_input import PAD_UNIT, SentencePieceFastInput
from fairseq_plugins.modules.slowfast.subword_characters import SubwordCharacterTable
from tests.models.slowfast.test_slowfast_modules import _batch, build_model

# --- Linformer --------------------------------------------------------------------------


def test_linformer_is_softmax_over_projected_keys_and_values():
    torch.manual_seed(0)
    attn = LinformerSelfAttention(8, 2, projected_length=3, max_length=10).double().eval()
    x = torch.randn(6, 1, 8, dtype=torch.float64)
    e, f = attn.key_compression[:, :6], attn.value_compression[:, :6]
    q = attn.q_proj(x[:, 0]).view(6, 2, 4).transpose(0, 1)  # H x L x d
    k = (e @ attn.k_proj(x[:, 0])).view(3, 2, 4).transpose(0, 1)  # H x k x d
    v = (f @ attn.v_proj(x[:, 0])).view(3, 2, 4).transpose(0, 1)
    expected = torch.softmax(q @ k.transpose(1, 2) / 2.0, -1) @ v  # sqrt(d) = 2
    expected = attn.out_proj(expected.transpose(0, 1).reshape(6, 8))
    assert torch.allclose(attn(x, None)[:, 0], expected)


@pytest.mark.parametrize("left_pad", [True, False])
def test_linformer_output_does_not_depend_on_the_batch(left_pad):
    torch.manual_seed(0)
    attn = LinformerSelfAttention(8, 2, projected_length=4, max_length=16).double().eval()
    short, long_ = torch.randn(3, 1, 8, dtype=torch.float64), torch.randn(7, 1, 8, dtype=torch.float64)
    pad = torch.full((4, 1, 8), 1e3, dtype=torch.float64)
    x = torch.cat([torch.cat([pad, short] if left_pad else [short, pad]), long_], 1)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    if left_pad:
        mask[0, :4] = True
    else:
        mask[0, 3:] = True
    out = attn(x, mask)
    real = out[:, 0][~mask[0]]
    assert torch.allclose(real, attn(short, None)[:, 0])
    assert torch.allclose(out[:, 1], attn(long_, None)[:, 0])


def test_linformer_refuses_long_sequences_and_relative_positions():
    attn = LinformerSelfAttention(8, 2, projected_length=4, max_length=5)
    with pytest.raises(ValueError, match="fast-linear-attention-max-length"):
        attn(torch.randn(6, 1, 8), None)
    with pytest.raises(ValueError, match="band"):
        attn(torch.randn(4, 1, 8), None, band=torch.ones(1, 4, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="positive"):
        LinformerSelfAttention(8, 2, projected_length=0, max_length=5)


def test_model_with_linear_fast_attention_has_no_boundary_pe_and_trains():
    d = _subword_dictionary()
    model = build_model(d, fast_self_attention="linear", fast_linear_attention_length=4).train()
    assert model.encoder.boundary_pe_window is None
    assert all(isinstance(layer.self_attn, LinformerSelfAttention) for layer in model.encoder.fast_layers)
    src = _batch(d, ["a swi@@ ss", "the dog runs"])
    out, _ = model(src, src.ne(d.pad()).sum(1), torch.full((2, 3), d.eos()))
    out.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []


# --- sentencepiece fast input ------------------------------------------------------------

WORDS = "a swi@@ ss bicy@@ cle the dog runs fast@@ er".split()
TRAINING_TEXT = [
    "a man rides a swiss bicycle",
    "the dog runs faster than the cat",
    "a swiss dog",
    "faster bicycles",
] * 20


def _subword_dictionary():
    d = Dictionary()
    for w in WORDS:
        d.add_symbol(w)
    return d


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A tiny unigram model of the words above, as a file."""
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAINING_TEXT), model_writer=proto, vocab_size=40, hard_vocab_limit=False,
        minloglevel=3,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("spm") / "fast.model"
    path.write_bytes(proto.getvalue())
    return path


def _resegmenter(d, path):
    return SentencePieceFastInput(SubwordCharacterTable(d), d, path.read_bytes())


def _reference_pieces(path, words):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    return [sp.encode(w, out_type=str) for w in words]


def _units(module, d, sentences):
    src = _batch(d, sentences)
    return module(src, *SubwordCharacterTable(d).subword_word_boundaries(src)), src


def test_words_are_rebuilt_from_subwords_and_segmented_by_the_model(sentencepiece_model):
    d = _subword_dictionary()
    module = _resegmenter(d, sentencepiece_model)
    fast, src = _units(module, d, ["a swi@@ ss bicy@@ cle"])
    sp = module.processor
    units = fast.tokens[0][~fast.padding_mask[0]].tolist()
    expected = [p for word in _reference_pieces(sentencepiece_model, ["a", "swiss", "bicycle"]) for p in word]
    assert [sp.id_to_piece(u - module.first_piece) for u in units[:-1]] == expected
    assert units[-1] == module.special_units[d.eos()]  # </s> stays a unit of its own
    sizes = [len(p) for p in _reference_pieces(sentencepiece_model, ["a", "swiss", "bicycle"])]
    real_words = fast.word_ids[0][~fast.padding_mask[0]].tolist()
    assert real_words == [0] * sizes[0] + [1] * sizes[1] + [2] * sizes[2] + [3]
    # each piece points at the subword its first character comes from
    positions = dict(zip(range(src.size(1)), src[0].tolist()))
    first_of_word = {0: "a", 1: "swi@@", 2: "bicy@@"}
    subwords = fast.subword_ids[0][~fast.padding_mask[0]].tolist()
    for word in range(len(sizes)):
        first = subwords[sum(sizes[:word])]
        assert d[positions[first]] == first_of_word[word]
    assert d[positions[subwords[sum(sizes[:2]) - 1]]] in ("swi@@", "ss")


def test_a_sentence_resegments_the_same_alone_and_in_a_batch(sentencepiece_model):
    d = _subword_dictionary()
    module = _resegmenter(d, sentencepiece_model)
    sentences = ["the dog", "a swi@@ ss bicy@@ cle runs fast@@ er", "dog"]
    batch, _ = _units(module, d, sentences)
    for i, s in enumerate(sentences):
        alone, _ = _units(module, d, [s])
        n = int((~alone.padding_mask[0]).sum())
        assert torch.equal(batch.tokens[i, :n], alone.tokens[0]) and (batch.tokens[i, n:] == PAD_UNIT).all()
        assert torch.equal(batch.word_ids[i, :n], alone.word_ids[0])


def test_the_state_dict_carries_the_model(sentencepiece_model):
    d = _subword_dictionary()
    module = _resegmenter(d, sentencepiece_model)
    empty = SentencePieceFastInput(SubwordCharacterTable(d), d, None, num_pieces=module.processor.get_piece_size())
    assert empty.processor is None
    empty.load_state_dict(module.state_dict())
    sentences = ["a swi@@ ss bicy@@ cle"]
    assert torch.equal(_units(empty, d, sentences)[0].tokens, _units(module, d, sentences)[0].tokens)
    wrong_size = SentencePieceFastInput(SubwordCharacterTable(d), d, None, num_pieces=3)
    with pytest.raises(RuntimeError, match="pieces"):
        wrong_size.load_state_dict(module.state_dict())


def test_model_with_sentencepiece_fast_input(sentencepiece_model, tmp_path):
    d = _subword_dictionary()
    model = build_model(d, fast_input="sentencepiece", fast_sentencepiece_model=str(sentencepiece_model)).train()
    assert model.encoder.fast_embed_tokens.num_embeddings == model.encoder.sentencepiece.num_units
    src = _batch(d, ["a swi@@ ss", "the dog runs"])
    out, _ = model(src, src.ne(d.pad()).sum(1), torch.full((2, 3), d.eos()))
    out.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    # alone and in a padded batch
    model.eval()
    sentences = ["the dog", "a swi@@ ss bicy@@ cle runs fast@@ er"]
    batch = model.encoder(_batch(d, sentences))
    for i, s in enumerate(sentences):
        alone = model.encoder(_batch(d, [s]))["encoder_out"][0][:, 0]
        real = batch["encoder_out"][0][:, i][~batch["encoder_padding_mask"][0][i]]
        assert torch.allclose(real, alone, atol=1e-5)
    with pytest.raises(ValueError, match="fast-sentencepiece-model"):
        build_model(d, fast_input="sentencepiece")
    with pytest.raises(FileNotFoundError):
        build_model(d, fast_input="sentencepiece", fast_sentencepiece_model=str(tmp_path / "missing.model"))
