"""``fairseq-hydra-train`` trains every plugin model from its ``configs/hydra/<model>.yaml``.

Each config is run as a user would (the console script, ``--config-dir configs/hydra``) for its
3 updates on tiny data; the checkpoint then shows that the model's own options, which only
reach a model under hydra through its config dataclass, were the config's.
"""

import pytest
import torch

from tests.classification_data import write_classification
from tests.cli import REPO, USER_DIR, run_cli
from tests.document_fixture import binarized_doc_fixture

CONFIGS = REPO / "configs" / "hydra"

# config -> a check that the model was built with that config's own options
BUILT_AS_CONFIGURED = {
    "bpt_transformer": lambda m: m.encoder._spec.k == 2 and m.encoder.embed_positions is None
    and m.decoder.layers[0].cross_attention_from == "tokens",
    "segtree_transformer": lambda m: m.encoder._spec.kind == "segtree" and m.encoder._spec.clip == 4,
    "bpt_document": lambda m: m.encoder._spec.k == 2 and type(m.decoder).__name__ == "DocumentGraphDecoder",
    "transformer_document": lambda m: type(m.decoder).__name__ == "DocumentTransformerDecoder",
    "transformer_slowfast": lambda m: m.encoder.fast_embed_tokens.embedding_dim == 8,
    "ms_transformer": lambda m: type(m.decoder.layers[0]).__name__ == "MultiScaleDecoderLayer",
    "transformer_classifier": lambda m: m.readout == "mean"
    and "sentence_classification_head" in m.classification_heads,
    "bpt_classifier": lambda m: m.encoder._spec.k == 1 and m.encoder._spec.clip == 3 and m.readout == "root",
    "segtree_classifier": lambda m: m.encoder._spec.kind == "segtree" and m.encoder._spec.clip == 3
    and m.classification_heads["sentence_classification_head"].dense is not None,
    "ms_classifier": lambda m: m.readout == "max" and len(m.encoder.layers[0].scales) == 2
    and not hasattr(m.encoder.layers[0], "fc1"),  # the paper's layer without FFN, from the architecture
    "bpt_lm": lambda m: m.decoder._spec.k == 2 and m.decoder._spec.clip == 3 and m.decoder.embed_positions is None
    and len(m.decoder.layers) == 2,
    "segtree_lm": lambda m: m.decoder._spec.kind == "segtree" and m.decoder._spec.clip == 2,
    "window_lm": lambda m: m.decoder.window == 8 and len(m.decoder.layers) == 2,
    "transformer_lm_matched": lambda m: m.decoder.dropout_module.p == 0.2 and m.decoder.output_dropout.p == 0.1
    and m.decoder.dropout_module.norm is not None and not m.decoder.layers[0].normalize_before,
    "sparse_lm": lambda m: (m.decoder._spec.stride, m.decoder._spec.summary) == (8, 2)
    and m.decoder.embed_positions is not None,
}
CLASSIFIERS = {"transformer_classifier", "bpt_classifier", "segtree_classifier", "ms_classifier"}
LANGUAGE_MODELS = {"bpt_lm", "segtree_lm", "window_lm", "transformer_lm_matched", "sparse_lm"}


def test_one_config_per_model():
    from fairseq.models import MODEL_REGISTRY

    import fairseq_plugins.models  # noqa: F401

    plugin_models = {name for name, cls in MODEL_REGISTRY.items() if cls.__module__.startswith("fairseq_plugins.")}
    assert plugin_models == {p.stem for p in CONFIGS.glob("*.yaml")} == set(BUILT_AS_CONFIGURED)


@pytest.fixture(scope="module")
def document_data_bin(tmp_path_factory):
    return binarized_doc_fixture(tmp_path_factory.mktemp("doc"))


@pytest.fixture(scope="module")
def sentence_data_bin(tmp_path_factory):
    return write_classification(tmp_path_factory.mktemp("sentences"), n_train=32, n_eval=8)


def data_fixture(name: str) -> str:
    if name in CLASSIFIERS:
        return "sentence_data_bin"
    if name in LANGUAGE_MODELS:
        return "enwik8_bin"  # tests/conftest.py
    return "document_data_bin" if name.endswith("_document") else "tiny_data_bin"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILT_AS_CONFIGURED))
def test_hydra_train(name, request, tmp_path):
    from fairseq import checkpoint_utils

    data = request.getfixturevalue(data_fixture(name))
    save = tmp_path / "ckpt"
    run_cli(
        "fairseq-hydra-train", "--config-dir", CONFIGS, "--config-name", name, f"task.data={data}",
        f"common.user_dir={USER_DIR}", f"checkpoint.save_dir={save}", f"hydra.run.dir={tmp_path / 'hydra'}",
    )  # fmt: skip
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 3
    models, _cfg, _task = checkpoint_utils.load_model_ensemble_and_task(
        [str(save / "checkpoint_last.pt")], arg_overrides={"data": str(data)})
    assert BUILT_AS_CONFIGURED[name](models[0])
    assert all(torch.isfinite(p).all() for p in models[0].parameters())
