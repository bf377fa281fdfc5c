"""fairseq's wrapping of a transformer layer, for models that build their own layers.

fairseq's ``build_encoder_layer``/``build_decoder_layer`` wrap each layer for
``--checkpoint-activations`` (with ``--offload-activations``) and FSDP; a model that
overrides those hooks must do the same, or the options are silently ignored.
"""

from fairseq.distributed import fsdp_wrap
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from torch import nn


def wrap_layer(layer: nn.Module, cfg) -> nn.Module:
    """Activation checkpointing and FSDP wrapping, as fairseq does for its own layers."""
    if cfg.checkpoint_activations:
        layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
    return fsdp_wrap(layer, min_num_params=cfg.min_params_to_wrap if not cfg.checkpoint_activations else 0)
