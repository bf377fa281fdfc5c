"""One training update's time by part of the model: forward and backward, per module kind.

``torch.profiler`` reports ATen ops; what a model comparison needs is which part of the
model they ran for. Every module whose path matches a ``PARTS`` rule runs inside a
``record_function`` of its part (the innermost one wins); an op run in forward counts for
the part it ran in, and a backward node (``autograd::engine::evaluate_function``) for the
part of the forward op that created it (the two share a sequence number). Code of the
encoder/decoder outside any such module (graph building, node padding, masks, residual
adds, the activation function) counts as ``encoder (rest)`` / ``decoder (rest)``.
Inside self-attention, the graph attention kernels (the ``fairseq_plugins::cpu_graph_attention`` op and its backward:
what BPT and SegTree run on CPU, relative keys included) count as ``graph attention
kernel``, and gathers as ``relative keys (gather)``: the torch backend's dense graph path
gathers its relative-key bias, the other attentions gather nothing.

The loss and the output layer are the same computation in every model, yet a single
profiled update of them varies by up to 2x (they are memory-bound over the B x T x vocabulary
logits, whose pages are fresh from the allocator every update): take the median of a few
rounds, and read the models' differences on the ``model body`` line, which leaves them out.

The floor (``span_floor``): BPT's and SegTree's design runs every side's span nodes (a
sentence of n tokens has ``sum(tree_level_sizes(n)) - n`` of them, about n - 1) through every
layer's q/k/v projections, and, but for the last layer, whose span rows nobody reads, through
the output projection and the FFN: about twice the transformer's rows there. The floor is the
transformer's profiled update plus those GEMMs' FLOPs (forward and backward, the batch's own
sentence lengths, no padding) at the seconds per FLOP that the transformer's FFN ran at in the
same profile. It leaves out what else the span rows cost (layer norms, dropout, residuals, the
attention over more keys), so it is a lower bound: what a model runs above it is padding of
span rows, graph and mask work, the attention core and those element-wise passes.
"""

import re
import statistics
from collections import Counter
from typing import Dict, List, Optional

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PARTS = [  # (regex on the module's path, part), first match wins
    (r"(^|\.)(q_proj|k_proj|v_proj|out_proj)$", "projections"),
    (r"(^|\.)(fc1|fc2)$", "ffn"),
    (r"layer_norm", "layer norms"),
    (r"dropout_module$", "dropout"),
    (r"encoder_attn$", "cross-attention"),
    (r"self_attn$", "self-attention"),
    (r"word_graph$", "s-gcn"),
    (r"fusion$", "cross-granularity fusion"),
    (r"output_projection$", "output layer"),
    (r"embed_tokens$|embed_positions$", "embeddings"),
    (r"^encoder$", "encoder (rest)"),
    (r"^decoder$", "decoder (rest)"),
]
SHARED = ("loss", "output layer", "optimizer")  # the same computation in every model
PREFIX = "part: "
BACKWARD = "autograd::engine::evaluate_function: "


def label_parts(model) -> None:
    """Run the forward of every module that matches a rule inside its part's record_function."""
    for path, module in model.named_modules():
        part = next((part for pattern, part in PARTS if re.search(pattern, path)), None)
        if part is None or getattr(module, "_profile_part", None):
            continue

        def forward(*args, _forward=module.forward, _name=PREFIX + part, **kwargs):
            with record_function(_name):
                return _forward(*args, **kwargs)

        module.forward, module._profile_part = forward, part


def _part(event) -> str:
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name[len(PREFIX):]
        event = event.cpu_parent
    return "other"


def _in_backward(event) -> bool:
    while event is not None:
        if event.name.startswith(BACKWARD):
            return True
        event = event.cpu_parent
    return False


def update_split(model, optimizer, batch, pad) -> Dict[str, float]:
    """Seconds of one update (forward, backward, Adam step) by part of the model."""
    label_parts(model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.zero_grad()
        logits, _ = model(batch["src_tokens"], batch["src_lengths"], batch["prev_output_tokens"])
        with record_function(PREFIX + "loss"):
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["target"], ignore_index=pad)
        loss.backward()
        with record_function(PREFIX + "optimizer"):
            optimizer.step()
    events = [event for event in prof.events() if not event.name.startswith(PREFIX)]
    forward_part, seconds = {}, Counter()
    for event in events:
        if event.name.startswith(BACKWARD) or _in_backward(event):
            continue
        part = _part(event)
        if part == "self-attention" and ("GraphAttention" in event.name or "graph_attention" in event.name):
            part = "graph attention kernel"
        elif part == "self-attention" and "gather" in event.name:
            part = "relative keys (gather)"
        if event.sequence_nr >= 0:
            forward_part.setdefault(event.sequence_nr, part)
        seconds[part] += event.self_cpu_time_total / 1e6
    for event in events:
        if event.name.startswith(BACKWARD):
            seconds[forward_part.get(event.sequence_nr, "other")] += event.cpu_time_total / 1e6
    return dict(seconds)


def median_split(rounds: List[Dict[str, float]]) -> Dict[str, float]:
    """Per part, the median over rounds, with the ``model body`` (all but ``SHARED``) and ``total``."""
    parts = set().union(*rounds)
    split = {part: statistics.median(r.get(part, 0.0) for r in rounds) for part in parts}
    split["model body"] = statistics.median(sum(t for p, t in r.items() if p not in SHARED) for r in rounds)
    split["total"] = statistics.median(sum(r.values()) for r in rounds)
    return split


def split_table(split: Dict[str, Dict[str, float]], baseline: str = "transformer") -> str:
    """Markdown: the baseline's seconds per part, and every other model's difference to it."""
    names = list(split)
    sums = ["model body", "total"]
    parts = sorted(set().union(*split.values()) - set(sums),
                   key=lambda p: -max(abs(s.get(p, 0.0) - split[baseline].get(p, 0.0)) for s in split.values()))
    rows = ["| part | " + " | ".join(n if n == baseline else f"{n} (+/-)" for n in names) + " |",
            "|---|" + "---|" * len(names)]
    for part in parts + sums:
        base = split[baseline].get(part, 0.0)
        cells = [f"{base:.3f}" if name == baseline else f"{split[name].get(part, 0.0) - base:+.3f}" for name in names]
        rows.append(f"| {part} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _linear_flops(rows: int, d: int, f: int, layers: int, span_layers_full: int) -> float:
    """Forward + backward FLOPs of ``rows`` span rows: q/k/v in every layer, out_proj and FFN in
    ``span_layers_full`` of them."""
    return 3 * 2 * rows * (layers * 3 * d * d + span_layers_full * (d * d + 2 * d * f))


def span_floor(baseline_split: Dict[str, float], split: Dict[str, float], model, batch, pad) -> Optional[dict]:
    """The span-row floor of a BPT/SegTree model (None for models without span nodes) and how far
    ``split`` (the model's median profile) is above it; ``baseline_split``: the transformer's."""
    from fairseq_plugins.graphs.binary_partition import tree_level_sizes
    from fairseq_plugins.modules.bpt.graph_transformer import GraphTransformerDecoder, GraphTransformerEncoder

    lengths = {"encoder": batch["src_lengths"].tolist(), "decoder": batch["target"].ne(pad).sum(1).tolist()}
    padded = {"encoder": batch["src_tokens"].numel(), "decoder": batch["target"].numel()}
    sides = {"encoder": (model.encoder, GraphTransformerEncoder), "decoder": (model.decoder, GraphTransformerDecoder)}
    ffn_flops = extra = 0.0
    for side, (module, graph_class) in sides.items():
        layers = len(module.layers)
        f, d = module.layers[0].fc1.weight.shape
        ffn_flops += 3 * 2 * padded[side] * 2 * d * f * layers  # the transformer's FFN over padded tokens
        if isinstance(module, graph_class):
            span_rows = sum(sum(tree_level_sizes(n)) - n for n in lengths[side])
            extra += _linear_flops(span_rows, d, f, layers, layers - 1)
    if not extra:
        return None
    seconds = extra * baseline_split["ffn"] / ffn_flops
    floor, body_floor = baseline_split["total"] + seconds, baseline_split["model body"] + seconds
    return dict(span_seconds=seconds, floor=floor, floor_ratio=floor / baseline_split["total"],
                measured_ratio=split["total"] / baseline_split["total"], above_floor=split["total"] / floor,
                body_above_floor_seconds=split["model body"] - body_floor)


def floor_table(floors: Dict[str, Optional[dict]], baseline: str = "transformer") -> str:
    """Markdown: each span-node model's floor and its distance from it."""
    rows = ["| model | span rows' projections + FFN (s, estimate) | floor x transformer | profiled x transformer "
            "| x floor | model body above the floor (s) |", "|---|---:|---:|---:|---:|---:|"]
    for name, f in floors.items():
        if name == baseline:
            continue
        if f is None:
            rows.append(f"| {name} | no span nodes | - | - | - | - |")
            continue
        rows.append(f"| {name} | {f['span_seconds']:.3f} | {f['floor_ratio']:.2f}x | {f['measured_ratio']:.2f}x | "
                    f"{f['above_floor']:.2f}x | {f['body_above_floor_seconds']:+.3f} |")
    return "\n".join(rows)
