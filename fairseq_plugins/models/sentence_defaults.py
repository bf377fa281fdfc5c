"""Defaults of the classifier and tagger architectures: each only sets what it changes."""

from fairseq.models.transformer.transformer_legacy import base_architecture

from fairseq_plugins.models.model_options import own_fields, set_default_options

# the papers' classification encoders: d 300, FFN 600, 6 heads (BPT Table 8), 4 layers (its SST setting)
CLASSIFIER_SIZE = dict(encoder_embed_dim=300, encoder_ffn_embed_dim=600, encoder_attention_heads=6, encoder_layers=4)


def classifier_defaults(args, config_cls, **values) -> None:
    """Give unset options ``values`` (model options or fairseq's ``encoder_*`` sizes), then
    the classification size, then the config's and fairseq's transformer defaults."""
    own = {f.name for f in own_fields(config_cls)}
    for name, value in {**CLASSIFIER_SIZE, **{k: v for k, v in values.items() if k not in own}}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    set_default_options(args, config_cls, **{k: v for k, v in values.items() if k in own})
    base_architecture(args)
