"""``window_lm``: fairseq's ``transformer_lm`` restricted to a causal window (BPT Figure 5's
"Restricted Transformer", Vaswani et al. 2017): token t attends to tokens t - w + 1 .. t only,
an attention degree of w, the baseline that BPT's k is compared with at the same degree.

Everything but the mask is ``transformer_lm``'s (absolute sinusoidal positions, pre-norm).
Training and scoring mask the scores outside the band; incremental decoding keeps only the
last w - 1 keys/values of each layer, so a sampled token costs O(w) and equals the full
computation.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder
from fairseq.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig, base_lm_architecture
from fairseq.utils import safe_getattr
from torch import Tensor

from fairseq_plugins.models.model_options import (
    add_config_args, check_at_least, check_lm_context, lm_max_positions,
)
from fairseq_plugins.models.plugin_model import PluginModel


@dataclass
class WindowLanguageModelConfig(TransformerLanguageModelConfig):
    attention_window: int = field(default=64, metadata={"help": "tokens each token attends to, itself included"})


class WindowTransformerDecoder(TransformerDecoder):
    def __init__(self, args, dictionary, embed_tokens, window: int):
        self.window = window
        super().__init__(args, dictionary, embed_tokens, no_encoder_attn=True)

    def buffered_future_mask(self, tensor):
        """fairseq's causal mask, plus -inf for keys more than w - 1 tokens back."""
        mask = super().buffered_future_mask(tensor)
        dim = mask.size(0)
        rows = torch.arange(dim, device=mask.device)
        too_far = rows.unsqueeze(0) <= rows.unsqueeze(1) - self.window
        return mask.masked_fill(too_far, float("-inf"))

    def extract_features_scriptable(self, prev_output_tokens, encoder_out=None,
                                    incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                                    *args, **kwargs):
        out = super().extract_features_scriptable(prev_output_tokens, encoder_out, incremental_state, *args, **kwargs)
        if incremental_state is not None:
            for layer in self.layers:
                self._keep_last(layer.self_attn, incremental_state, self.window - 1)
        return out

    @staticmethod
    def _keep_last(attention, incremental_state, keep: int) -> None:
        """Drop the cached keys/values the next step's window no longer reaches."""
        cache = attention._get_input_buffer(incremental_state)
        if "prev_key" not in cache or cache["prev_key"].size(2) <= keep:
            return
        for name, dim in (("prev_key", 2), ("prev_value", 2), ("prev_key_padding_mask", 1)):
            value = cache.get(name)
            if value is not None:
                cache[name] = value.narrow(dim, value.size(dim) - keep, keep) if keep else value[..., :0]
        attention._set_input_buffer(incremental_state, cache)


@register_model("window_lm")
class WindowLanguageModel(PluginModel, TransformerLanguageModel):
    language_model = True

    @classmethod
    def add_args(cls, parser):
        add_config_args(parser, WindowLanguageModelConfig)

    @classmethod
    def build_model(cls, args, task):
        cls.check_task(args, task)
        check_at_least(args, "attention_window", 1)
        if getattr(args, "character_embeddings", False) or getattr(args, "adaptive_input", False):
            raise ValueError("window_lm takes plain token embeddings (no --character-embeddings/--adaptive-input)")
        lm_max_positions(args, "window_lm")
        check_lm_context(args, task, "window_lm")
        embed_tokens = cls.build_embedding(args, task.source_dictionary, args.decoder_input_dim)
        return cls(WindowTransformerDecoder(args, task.target_dictionary, embed_tokens, args.attention_window))


@register_model_architecture("window_lm", "window_lm")
def window_lm(args):
    args.attention_window = safe_getattr(args, "attention_window", 64)
    base_lm_architecture(args)
