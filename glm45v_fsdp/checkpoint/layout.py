"""Checkpoint key layouts: the one place that knows how model tensors map to checkpoint tensors.

The model (transformers 5) stores each MoE layer's routed experts stacked: `...mlp.experts.gate_up_proj` (E, 2I, H),
the concatenation of every expert's gate and up projections along dim 1 (gate rows first), and
`...mlp.experts.down_proj` (E, H, I). The Hub stores them per expert: `...mlp.experts.{e}.gate_proj.weight` (I, H),
`...up_proj.weight` (I, H) and `...down_proj.weight` (H, I); that is also what transformers' `save_pretrained`
writes (its qwen2_moe conversion reversed). Every other tensor keeps its name and shape in both layouts.
Loading, export and inspection all go through `checkpoint_pieces` and `check_keys` / `compare_keys`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from glm45v_fsdp.adapters import is_adapter
from glm45v_fsdp.errors import UserError

EXPERT_LAYOUTS = ("per-expert", "stacked")
Shape = tuple[int, ...]

_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^.*\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor `key` holding the box `offset` + `size` of a model tensor.

    With `squeeze`, the box is one expert (size 1 on dim 0) and the checkpoint tensor lacks that dim.
    """

    key: str
    offset: Shape
    size: Shape
    squeeze: bool = False

    @property
    def shape(self) -> Shape:
        """The checkpoint tensor's shape."""
        return self.size[1:] if self.squeeze else self.size


def detect_expert_layout(keys: Iterable[str]) -> str | None:
    """'per-expert' or 'stacked' from a checkpoint's keys; None when it holds no routed experts."""
    per_expert = stacked = None
    for key in keys:
        if per_expert is None and _PER_EXPERT.match(key):
            per_expert = key
        elif stacked is None and _STACKED.match(key):
            stacked = key
    if per_expert and stacked:
        raise UserError(
            f"The checkpoint mixes expert layouts: '{per_expert}' is per expert but '{stacked}' is stacked. A "
            f"checkpoint must store all routed experts one way; write it again with one layout (transformers' "
            f"save_pretrained and this project's export write per expert)."
        )
    return "per-expert" if per_expert else "stacked" if stacked else None


def checkpoint_pieces(name: str, shape: Shape, layout: str | None) -> list[Piece]:
    """The checkpoint tensors that make up model tensor `name` (global `shape`) in `layout`."""
    assert layout in (*EXPERT_LAYOUTS, None), layout
    whole = [Piece(name, (0,) * len(shape), tuple(shape))]
    match = _STACKED.match(name)
    if layout != "per-expert" or match is None:
        return whole
    prefix, proj = match["prefix"], match["proj"]
    experts, rows, cols = shape
    if proj == "down_proj":
        return [Piece(f"{prefix}.{e}.down_proj.weight", (e, 0, 0), (1, rows, cols), True) for e in range(experts)]
    half = rows // 2
    return [
        Piece(f"{prefix}.{e}.{part}_proj.weight", (e, i * half, 0), (1, half, cols), True)
        for e in range(experts)
        for i, part in enumerate(("gate", "up"))
    ]


def expected_keys(shapes: Mapping[str, Shape], layout: str | None) -> dict[str, Shape]:
    """Checkpoint key -> shape that a model with these tensor shapes expects in `layout`."""
    return {
        piece.key: piece.shape for name, shape in shapes.items() for piece in checkpoint_pieces(name, shape, layout)
    }


def model_to_hub_tensors(name: str, full_tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A full model tensor as the Hub's (per-expert) checkpoint tensors: (key, tensor view) pairs."""
    result = []
    for piece in checkpoint_pieces(name, tuple(full_tensor.shape), "per-expert"):
        view = full_tensor[tuple(slice(o, o + s) for o, s in zip(piece.offset, piece.size))]
        result.append((piece.key, view[0] if piece.squeeze else view))
    return result


@dataclass
class KeyDiff:
    """How a checkpoint's keys differ from what the model expects (sorted lists)."""

    missing: list[str]
    unexpected: list[str]
    mismatched: list[str]  # "key: checkpoint [a, b] vs model [c, d]"
    # Unexpected decoder layers past the model's last one: "prefix.N" -> the model's layer count under prefix.
    extra_layers: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def compare_keys(expected: Mapping[str, Shape], found: Mapping[str, Shape]) -> KeyDiff:
    """Missing, unexpected and shape-mismatched keys of `found` (checkpoint) against `expected` (model)."""
    mismatched = [
        f"{key}: checkpoint {list(found[key])} vs model {list(shape)}"
        for key, shape in sorted(expected.items())
        if key in found and tuple(found[key]) != tuple(shape)
    ]
    return KeyDiff(sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys()), mismatched)


def prefix_hint(diff: KeyDiff) -> str:
    """A sentence naming a key prefix the checkpoint has too much or too little, or '' when none explains the diff."""
    missing, unexpected = set(diff.missing), set(diff.unexpected)
    votes: Counter[tuple[str, str]] = Counter()
    for keys, others, kind in ((unexpected, missing, "extra"), (missing, unexpected, "lacking")):
        for key in keys:
            for match in re.finditer(r"\.", key):
                if key[match.end() :] in others:
                    votes[(kind, key[: match.end()])] += 1
    if not votes:
        return ""
    (kind, prefix), count = votes.most_common(1)[0]
    if kind == "extra":
        example = next(k for k in sorted(unexpected) if k.startswith(prefix) and k[len(prefix) :] in missing)
        return (
            f" The checkpoint's keys carry an extra prefix '{prefix}' ({count} keys, e.g. checkpoint '{example}' "
            f"where the model has '{example[len(prefix) :]}'): it was saved from a wrapper; strip that prefix."
        )
    example = next(k for k in sorted(missing) if k.startswith(prefix) and k[len(prefix) :] in unexpected)
    return (
        f" The checkpoint's keys lack the prefix '{prefix}' ({count} keys, e.g. checkpoint '{example[len(prefix) :]}' "
        f"where the model has '{example}'): it was saved from a sub-module; add that prefix."
    )


def describe_diff(diff: KeyDiff, limit: int = 20) -> str:
    """'N missing keys (first 20: ...); M unexpected ...; K shape mismatches ...' plus the prefix hint."""
    parts = [
        f"{len(items)} {label} ({'first ' + str(limit) + ': ' if len(items) > limit else ''}{', '.join(items[:limit])})"
        for label, items in (
            ("missing keys", diff.missing),
            ("unexpected keys", diff.unexpected),
            ("shape mismatches", diff.mismatched),
        )
        if items
    ]
    return "; ".join(parts) + "." + prefix_hint(diff) + layer_hint(diff)


def layer_hint(diff: KeyDiff) -> str:
    """A sentence on decoder layers the checkpoint has past the model's last, or ''."""
    if not diff.extra_layers:
        return ""
    layers = ", ".join(f"{layer}.*" for layer in diff.extra_layers)
    count = next(iter(diff.extra_layers.values()))
    return (
        f" The checkpoint has decoder layer(s) {layers} past the model's {count} (0-{count - 1}) and they are not a "
        f"multi-token-prediction (MTP) layer (whose {'/'.join(MTP_MARKERS)} tensors are skipped: this backend trains "
        f"no MTP head): it holds a deeper model; set model.config_overrides.text_config.num_hidden_layers to its "
        f"layer count, or convert it."
    )


def model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """(name -> parameter or persistent buffer, the names under which tied parameters appear a second time)."""
    tensors = dict(model.named_parameters())
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - tensors.keys()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                tensors[f"{module_name}.{name}" if module_name else name] = buffer
    return tensors, aliases


def check_keys(model: nn.Module, found: Mapping[str, Shape], layout: str | None) -> tuple[KeyDiff, list[str]]:
    """(diff of the checkpoint keys `found` against `model` in `layout`, ignored keys).

    Unexpected keys that the model class declares ignorable (`_keys_to_ignore_on_load_unexpected`: the MTP layer
    positions of GLM-4.5 / 4.6, layers 46 and 92) or that name a tied weight's alias are ignored, as transformers does;
    so is a multi-token-prediction layer past the last decoder layer at any index (its MTP_MARKERS tensors). Other
    layers past the last stay unexpected, and `diff.extra_layers` names them for the error's hint.
    """
    tensors, aliases = model_tensors(model)
    tensors = {name: tensor for name, tensor in tensors.items() if not is_adapter(name)}  # LoRA's: not the base's
    diff = compare_keys(expected_keys({name: tuple(t.shape) for name, t in tensors.items()}, layout), found)
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    ignored = [key for key in diff.unexpected if key in aliases or any(p.search(key) for p in patterns)]
    extra = _layers_past_the_last(tensors, sorted(set(diff.unexpected) - set(ignored)))
    for layer, keys in extra.items():
        if any(f".{marker}." in key[len(layer) :] for key in keys for marker in MTP_MARKERS):
            ignored += keys  # an MTP layer at any index, as transformers skips GLM-4.5's at 46
        else:
            diff.extra_layers[layer] = _layer_count(tensors, layer.rsplit(".", 1)[0])
    diff.unexpected = sorted(set(diff.unexpected) - set(ignored))
    return diff, sorted(ignored)


# The tensors of a multi-token-prediction layer (GLM-4.5 / DeepSeek-V3 style), kept after the decoder layers.
MTP_MARKERS = ("eh_proj", "enorm", "hnorm", "shared_head")
_LAYER = re.compile(r"^(?P<layers>.*\.layers)\.(?P<index>\d+)\.")


def _layer_count(tensors: Mapping[str, torch.Tensor], layers: str) -> int:
    indices = [int(m["index"]) for name in tensors if (m := _LAYER.match(name)) and m["layers"] == layers]
    return max(indices, default=-1) + 1


def _layers_past_the_last(tensors: Mapping[str, torch.Tensor], unexpected: list[str]) -> dict[str, list[str]]:
    """Unexpected keys of layers past the model's last under the same `....layers` prefix: {"prefix.N": keys}."""
    extra: dict[str, list[str]] = {}
    for key in unexpected:
        match = _LAYER.match(key)
        if match and int(match["index"]) >= _layer_count(tensors, match["layers"]) > 0:
            extra.setdefault(f"{match['layers']}.{match['index']}", []).append(key)
    return extra


def summarize_keys(keys: list[str], limit: int = 5) -> str:
    """'prefix.layers.46.* (12 tensors), other.key' — keys grouped by decoder layer, the first `limit` groups."""
    groups: dict[str, int] = {}
    for key in keys:
        match = _LAYER.match(key)
        group = f"{match['layers']}.{match['index']}.*" if match else key
        groups[group] = groups.get(group, 0) + 1
    named = [f"{group} ({count} tensors)" if count > 1 else group for group, count in list(groups.items())[:limit]]
    return ", ".join(named) + (f" and {len(groups) - limit} more" if len(groups) > limit else "")
