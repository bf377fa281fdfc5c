"""``--criterion aux_layer_cross_entropy``: BPT's character-level training objective.

The original (yzh119/BPT ``lm.py`` with ``modules/model.py``) trains its language models on the
mean of the losses of the upper layers: in epoch e of n (from 0), every layer i (from 1) with
i > L e / n reads out its token states through the shared output projection (with the output
dropout) and the objective is the mean of their losses. Epoch 0 averages all L layers, the last
epochs the top one alone. Here the n epochs are ``--aux-layer-stages`` equal stretches of
``--max-update``: in update u, stage e = min(n - 1, u n // max_update). Validation (and any
model in eval mode) scores the top layer alone, as the original's evaluation.
"""

from dataclasses import dataclass, field

from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from omegaconf import II


@dataclass
class AuxLayerCrossEntropyConfig(CrossEntropyCriterionConfig):
    aux_layer_stages: int = field(default=1, metadata={
        "help": "the original's n_epochs: the stages of --max-update over which the averaged layers "
                "shrink from all to the top one"})
    max_update: int = II("optimization.max_update")


def aux_layers(num_layers: int, stage: int, stages: int) -> list:
    """The layers (1-based) whose losses are averaged in ``stage`` of ``stages``: those above
    ``num_layers * stage / stages`` (the original's ``(i + 1) > len(self.layers) * aux``)."""
    return [layer for layer in range(1, num_layers + 1) if layer * stages > num_layers * stage]


@register_criterion("aux_layer_cross_entropy", dataclass=AuxLayerCrossEntropyConfig)
class AuxLayerCrossEntropyCriterion(CrossEntropyCriterion):
    def __init__(self, task, sentence_avg, aux_layer_stages, max_update):
        super().__init__(task, sentence_avg)
        if not isinstance(aux_layer_stages, int) or aux_layer_stages < 1:
            raise ValueError(f"--aux-layer-stages must be an integer >= 1, got {aux_layer_stages!r}")
        if not max_update or max_update < 1:
            raise ValueError("--criterion aux_layer_cross_entropy schedules its layers over --max-update: set it")
        self.stages = aux_layer_stages
        self.max_update = max_update

    def stage(self, num_updates: int) -> int:
        return min(self.stages - 1, num_updates * self.stages // self.max_update)

    def forward(self, model, sample, reduce=True):
        decoder = getattr(model, "decoder", None)
        if not hasattr(decoder, "layer_output"):
            raise ValueError("--criterion aux_layer_cross_entropy needs one of the plugin's language models "
                             "(bpt_lm, segtree_lm, window_lm, transformer_lm_matched archs)")
        if not model.training:
            return super().forward(model, sample, reduce=reduce)
        logits, extra = model(**sample["net_input"])
        states = extra["inner_states"]
        layers = aux_layers(len(states) - 1, self.stage(decoder.num_updates), self.stages)
        top = len(states) - 1
        readouts = (logits if layer == top else decoder.layer_output(states[layer]) for layer in layers)
        loss = sum(self.compute_loss(model, (readout, extra), sample, reduce=reduce)[0]
                   for readout in readouts) / len(layers)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {"loss": loss.data, "ntokens": sample["ntokens"], "nsentences": sample["target"].size(0),
                          "sample_size": sample_size}
        return loss, sample_size, logging_output
