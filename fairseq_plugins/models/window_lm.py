"""``window_lm``: fairseq's ``transformer_lm`` restricted to a causal window (BPT Figure 5's
"Restricted Transformer", Vaswani et al. 2017): token t attends to tokens t - w + 1 .. t only,
an attention degree of w, the baseline that BPT's k is compared with at the same degree.

Everything but the mask is ``transformer_lm_matched``'s (absolute sinusoidal positions, pre-norm, the LM
training options).
Training and scoring mask the scores outside the band; incremental decoding keeps only the
last w - 1 keys/values of each layer, so a sampled token costs O(w) and equals the full
computation.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerDecoder
from fairseq.models.transformer_lm import base_lm_architecture
from fairseq.utils import safe_getattr
from torch import Tensor

from fairseq_plugins.models.bpt_lm import bpt_paper_sizes
from fairseq_plugins.models.lm_training import LMTrainingConfig, LMTrainingDecoder
from fairseq_plugins.models.model_options import check_at_least
from fairseq_plugins.models.transformer_lm_matched import MatchedTransformerLanguageModel


@dataclass
class WindowLanguageModelConfig(LMTrainingConfig):
    attention_window: int = field(default=64, metadata={"help": "tokens each token attends to, itself included"})


class WindowTransformerDecoder(LMTrainingDecoder, TransformerDecoder):
    def __init__(self, training, args, dictionary, embed_tokens, window: int):
        self.window = window
        super().__init__(training, args, dictionary, embed_tokens, no_encoder_attn=True)

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
class WindowLanguageModel(MatchedTransformerLanguageModel):
    lm_name = "window_lm"
    config = WindowLanguageModelConfig

    @classmethod
    def build_model(cls, args, task):
        cls.check_task(args, task)
        check_at_least(args, "attention_window", 1)
        return super().build_model(args, task)

    @classmethod
    def build_lm_decoder(cls, training, args, dictionary, embed_tokens):
        return WindowTransformerDecoder(training, args, dictionary, embed_tokens, args.attention_window)


@register_model_architecture("window_lm", "window_lm")
def window_lm(args):
    args.attention_window = safe_getattr(args, "attention_window", 64)
    base_lm_architecture(args)


@register_model_architecture("window_lm", "window_lm_enwik8")
def window_lm_enwik8(args):
    """BPT Figure 5's restricted transformer: the sizes of ``bpt_lm_enwik8`` (BPT Table 9)."""
    bpt_paper_sizes(args)
    window_lm(args)
