"""Context parallelism (CP) for the language model: Ulysses, Ring attention, or both (hybrid u x r).

The sequence layout (parallel/sequence.py) gives each CP rank a part of every micro batch's tokens for the decoder
layers, the final norm and the loss: a contiguous slice under Ulysses alone, the zigzag ring block's slice with Ring.
Everything in a layer but attention (norms, rotary, the MoE block) is per token and runs on the local part. What runs
on every CP rank in full: token embedding, the merge of the image features, and the mask: the causal / packed /
padding mask under Ulysses alone, the ring's pieces of work (parallel/ring.py, O(samples) integers) with Ring.

Attention, after rotary:
  - Ulysses (u ranks): an all-to-all turns [B, heads, S/u, D] into [B, heads/u, S, D] (every rank sees the whole
    sequence, or its whole ring block, for a slice of the heads); a second one turns the output back.
  - Ring (r ranks): the rank's queries against every ring block, key/value blocks passed around the ring
    (parallel/ring.py); under hybrid, inside the Ulysses all-to-alls.
  - Neither in attention (Ulysses only): the configured kernel (sdpa or eager) runs unchanged with the full mask.

The Ulysses exchanges are torch's functional collectives (`all_to_all_single_autograd`) and the ring is one custom op:
ops a selective recompute policy can keep (memory/recompute.py keeps them), so backward does not exchange again.
Key/value heads under Ulysses: when there are at least as many as Ulysses ranks they are split like the query heads;
with fewer, each rank needs one key/value head for the whole sequence, which the exchange delivers from every
rank's slice (a head is repeated once per rank that needs it: the bytes any scheme must move). The ring sends the
key/value heads it holds as they are.

The plan (`apply_context_parallel`) patches `model.language_model.forward` and gives every text attention module its
own config naming the registered "glm45v_context" attention.
"""

from __future__ import annotations

import copy
import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers import AttentionInterface
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextAttention, eager_attention_forward

from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.module_patterns import PlanMatch, match_modules
from glm45v_fsdp.parallel.ring import Ring, ring_attention, ring_pieces, sequence_segments
from glm45v_fsdp.parallel.sequence import SplitSequence, ZigzagSequence

# transformers >= 5.24 names create_causal_mask's cache argument `cache`, 5.2-5.23 `past_key_values`
MASK_CACHE_KEY = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"

CONTEXT_ATTENTION = "glm45v_context"
CP_KERNELS = ("sdpa", "eager")  # attention kernels context parallelism has been verified with
LANGUAGE_MODEL = "model.language_model"


@dataclass(frozen=True)
class Ulysses:
    """The head <-> sequence exchange of one Ulysses group (size 1: none) and the attention kernel it wraps."""

    group: dist.ProcessGroup
    size: int
    kernel: str

    def describe(self) -> str:
        return (
            f"Ulysses context parallelism over {self.size} ranks: attention kernel {self.kernel} on the full "
            f"sequence for 1/{self.size} of the heads (all-to-all before and after); everything else on 1/{self.size} "
            f"of the tokens"
        )


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, ulysses: Ulysses) -> torch.Tensor:
    """Split `x` into `size` chunks along scatter_dim, send chunk j to rank j, concatenate what arrives (in rank
    order) along gather_dim; autograd's backward is the same exchange with the two dims swapped."""
    send = torch.stack(x.chunk(ulysses.size, dim=scatter_dim))
    received = all_to_all_single_autograd(send, None, None, ulysses.group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _LocalHeads:
    """The attention module as the kernel must see it after the head split: same attributes, except the number of
    query heads per key/value head, which changes when key/value heads were repeated to reach the CP size."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: query/key/value [B, heads, S/cp, D] (rotary applied) -> output
    [B, S/cp, heads, D]. `attention_mask` is the full sequence's mask, or the ring's pieces under Ring."""
    ulysses: Ulysses = module.ulysses
    ring: Ring | None = module.ring
    if ulysses.size > 1:
        kv_heads = key.shape[1]
        if kv_heads % ulysses.size:  # fewer key/value heads than Ulysses ranks: each rank receives the one it needs
            key = key.repeat_interleave(ulysses.size // kv_heads, dim=1)
            value = value.repeat_interleave(ulysses.size // kv_heads, dim=1)
        query, key, value = (all_to_all(t, 1, 2, ulysses) for t in (query, key, value))
    if ring is not None:
        output = ring_attention(query, key, value, attention_mask, ring, kwargs["scaling"])
    else:
        groups = query.shape[1] // key.shape[1]
        kernel_module = module if groups == module.num_key_value_groups else _LocalHeads(module, groups)
        kernel = ALL_ATTENTION_FUNCTIONS.get_interface(ulysses.kernel, eager_attention_forward)
        output, _ = kernel(kernel_module, query, key, value, attention_mask, **kwargs)  # [B, S, heads/u, D]
    if ulysses.size > 1:
        output = all_to_all(output, 1, 2, ulysses)
    return output, None


AttentionInterface.register(CONTEXT_ATTENTION, context_attention)


def ring_mask(
    layout: ZigzagSequence,
    batch: int,
    length: int,
    attention_mask: torch.Tensor | None,
    text_positions: torch.Tensor | None,
) -> torch.Tensor:
    """The ring's pieces of work for this micro batch (host integers: one device-to-host copy of the mask and the
    packed positions per micro batch, none per layer)."""
    masks = attention_mask.tolist() if attention_mask is not None else None
    positions = text_positions.tolist() if text_positions is not None else None
    rows = [
        sequence_segments(
            length, masks[row] if masks is not None else None, positions[row] if positions is not None else None
        )
        for row in range(batch)
    ]
    return ring_pieces(length, layout.ring, layout.ring_rank, rows)


def _language_model_forward(
    module: nn.Module,
    layout: SplitSequence,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> MoeModelOutputWithPast:
    """Glm4vMoeTextModel.forward for training under CP: full-sequence mask, then the layers on this rank's part.

    Takes what Glm4vMoeModel.forward hands its language model (the merged embeddings and the data pipeline's
    position ids [3, B, S], or [4, B, S] when packed) and returns this rank's part of the last hidden state.
    """
    assert inputs_embeds is not None and position_ids is not None and position_ids.ndim == 3, "merged inputs expected"
    assert cache is None and not use_cache, "context parallelism trains without a KV cache"
    inputs_embeds, attention_mask, position_ids = _pad_merged(layout, inputs_embeds, attention_mask, position_ids)
    if position_ids.shape[0] == 4:  # packed: row 0 holds per-sample text positions, from which the mask is built
        text_position_ids, position_ids = position_ids[0], position_ids[1:]
    else:
        text_position_ids = None
    if isinstance(layout, ZigzagSequence):
        mask = ring_mask(layout, *inputs_embeds.shape[:2], attention_mask, text_position_ids)
    else:
        mask = create_causal_mask(
            config=module.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=text_position_ids,
            **{MASK_CACHE_KEY: None},
        )
    hidden = layout.shard(inputs_embeds, dim=1)
    position_ids = layout.shard(position_ids, dim=2)
    position_embeddings = module.rotary_emb(hidden, position_ids)
    for layer in module.layers[: module.config.num_hidden_layers]:
        hidden = layer(
            hidden, position_embeddings=position_embeddings, attention_mask=mask, position_ids=position_ids, **kwargs
        )
    return MoeModelOutputWithPast(last_hidden_state=module.norm(hidden))


def _pad_merged(
    layout: SplitSequence, embeds: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The merged inputs right-padded to the layout's multiple when the caller did not pad the batch (a script that
    calls the backbone itself, as TRL's fused LM head does): zero embeddings after every real token, attended to
    (mask 1, as `pad_to_multiple`) and never supervised, so the real tokens' outputs are unchanged."""
    extra = -embeds.shape[1] % layout.multiple
    if extra == 0:
        return embeds, attention_mask, position_ids
    embeds = torch.nn.functional.pad(embeds, (0, 0, 0, extra))
    if attention_mask is not None:
        attention_mask = torch.nn.functional.pad(attention_mask, (0, extra), value=1)
    return embeds, attention_mask, torch.nn.functional.pad(position_ids, (0, extra))


def check_context_parallel(hf_config: Any, ulysses: int, kernel: str, ring: int = 1) -> None:
    """ConfigError when the model's heads cannot be split `ulysses` ways or the attention kernel is not one CP
    supports. Ring attention puts no condition on the heads (every ring rank computes all of its block's heads)."""
    text = hf_config.text_config
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    if heads % ulysses:
        raise ConfigError(
            f"Config key 'parallel.ulysses_parallel_size' = {ulysses} does not divide the model's "
            f"{heads} attention heads (Ulysses gives every CP rank heads/{ulysses} of them). Choose a divisor of "
            f"{heads}."
        )
    if kv_heads % ulysses and ulysses % kv_heads:
        raise ConfigError(
            f"Config key 'parallel.ulysses_parallel_size' = {ulysses} and the model's {kv_heads} key/value heads "
            f"neither divide one another, so the key/value heads cannot be split or replicated evenly. Choose a "
            f"divisor or a multiple of {kv_heads} that divides {heads}."
        )
    if kernel not in CP_KERNELS:
        raise ConfigError(
            f"Config key 'model.attn_implementation' = {kernel!r} is not supported with context parallelism "
            f"(parallel.ulysses_parallel_size = {ulysses}, parallel.ring_attention_size = {ring}) yet: its "
            f"packed-sequence path reads per-rank position ids. Set model.attn_implementation to one of "
            f"{', '.join(CP_KERNELS)}."
        )


def apply_context_parallel(
    model: nn.Module, layout: SplitSequence, ulysses: Ulysses, ring: Ring | None = None
) -> list[PlanMatch]:
    """The CP plan on the meta model (before FSDP): the model's sequence layout becomes `layout` (a ZigzagSequence
    with `ring`), the language model runs this rank's part of the sequence and every text attention module the
    context attention (Ulysses exchange, ring, or both)."""
    assert (ring is None) == (not isinstance(layout, ZigzagSequence)), "Ring attention needs the zigzag layout"
    matches = match_modules(model, [LANGUAGE_MODEL], "parallel.ulysses_parallel_size")
    language_model = model.get_submodule(LANGUAGE_MODEL)
    language_model.forward = functools.partial(_language_model_forward, language_model, layout)
    attention_config = copy.copy(language_model.config)
    attention_config._attn_implementation = CONTEXT_ATTENTION
    for module in language_model.modules():
        if isinstance(module, Glm4vMoeTextAttention):
            module.config = attention_config
            module.ulysses = ulysses
            module.ring = ring
    model.sequence_layout = layout
    return matches
