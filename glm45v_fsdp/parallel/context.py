"""Ulysses context parallelism (CP) for the language model: the sequence is split over the "cp" mesh dim.

Each CP rank keeps 1/cp of every micro batch's tokens through the decoder layers, the final norm and the loss. Inside
attention, an all-to-all turns [B, heads, S/cp, D] into [B, heads/cp, S, D] (every rank sees the whole sequence for
a slice of the heads), the configured attention kernel runs unchanged on it with the full-sequence mask, and a second
all-to-all turns the output back into [B, S/cp, heads, D]. Everything else in a layer (norms, rotary, the MoE block)
is per token and runs on the local slice.

The vision tower is split by images: each CP rank encodes a contiguous run of the micro batch's images (balanced by
patches) and the features are all-gathered (`gather_rows`), so every rank merges all of them into its copy of the
embeddings. What runs on every CP rank in full: token embedding, that merge, and the causal / packed / padding mask
(the rotary positions and the embeddings are then sliced). The loss labels are shifted on the whole sequence before
they are sliced, so a token whose target lies on the next rank is still supervised; the loss is normalised by the
*unsplit* batch's supervised tokens, and FSDP2 sums the gradients over dp_shard x cp, which adds the CP ranks'
partial gradients up to the full one.

The plan (`apply_context_parallel`) patches `model.language_model.forward` and gives every text attention module
its own config naming the registered "glm45v_ulysses" attention, which wraps the configured kernel (sdpa or eager).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeTextAttention, eager_attention_forward

from glm45v_fsdp.data.vocab import IGNORE_INDEX
from glm45v_fsdp.errors import ConfigError
from glm45v_fsdp.parallel.plan import PlanMatch, match_modules

ULYSSES_ATTENTION = "glm45v_ulysses"
CP_KERNELS = ("sdpa", "eager")  # attention kernels the Ulysses wrapper has been verified with
LANGUAGE_MODEL = "model.language_model"


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its CP group and the attention kernel the Ulysses wrapper calls."""

    group: dist.ProcessGroup
    size: int
    rank: int
    kernel: str

    def local(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous 1/size slice of `tensor` along `dim` (whose length size divides)."""
        chunk = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * chunk, chunk)

    def describe(self) -> str:
        return (
            f"Ulysses context parallelism over {self.size} ranks: attention kernel {self.kernel} on the full "
            f"sequence for 1/{self.size} of the heads (all-to-all before and after); everything else on 1/{self.size} "
            f"of the tokens"
        )


class _AllToAll(torch.autograd.Function):
    """Split `x` into `size` chunks along scatter_dim, send chunk j to rank j, concatenate what arrives (in rank
    order) along gather_dim. The backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int):
        ctx.dims, ctx.group, ctx.size = (scatter_dim, gather_dim), group, size
        return _exchange(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.size), None, None, None, None


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, size: int):
    send = torch.stack(x.chunk(size, dim=scatter_dim))
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, cp: ContextParallel) -> torch.Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, cp.group, cp.size)


class _LocalHeads:
    """The attention module as the kernel must see it after the head split: same attributes, except the number of
    query heads per key/value head, which changes when key/value heads were repeated to reach the CP size."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: query/key/value [B, heads, S/cp, D] (rotary applied) -> output
    [B, S/cp, heads, D], with `attention_mask` built for the full sequence."""
    cp: ContextParallel = module.context_parallel
    kv_heads = key.shape[1]
    if kv_heads % cp.size:  # fewer key/value heads than CP ranks: each rank gets a copy of the one it needs
        key = key.repeat_interleave(cp.size // kv_heads, dim=1)
        value = value.repeat_interleave(cp.size // kv_heads, dim=1)
    query, key, value = (all_to_all(t, 1, 2, cp) for t in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    kernel_module = module if groups == module.num_key_value_groups else _LocalHeads(module, groups)
    kernel = ALL_ATTENTION_FUNCTIONS.get_interface(cp.kernel, eager_attention_forward)
    output, _ = kernel(kernel_module, query, key, value, attention_mask, **kwargs)  # [B, S, heads/cp, D]
    return all_to_all(output, 1, 2, cp), None


AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)


def image_owners(patches_per_image: list[int], size: int) -> list[int]:
    """The CP rank that encodes each image: contiguous runs of images, balanced by patch count (an image goes to the
    rank whose share of the total its middle patch falls in)."""
    total = sum(patches_per_image)
    owners, before = [], 0
    for patches in patches_per_image:
        owners.append(min(size - 1, (2 * before + patches) * size // (2 * total)))
        before += patches
    return owners


class _GatherRows(torch.autograd.Function):
    """Concatenate every CP rank's rows (rank order; `counts[r]` rows from rank r). Backward: each rank's gradient of
    the whole is partial (it covers its slice of the sequence), so it is summed over the group before every rank
    keeps the rows it contributed."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, counts: list[int], cp: ContextParallel):
        ctx.counts, ctx.cp = counts, cp
        padded = rows.new_zeros(max(counts), *rows.shape[1:])
        padded[: rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded, group=cp.group)
        return torch.cat([part[:count] for part, count in zip(gathered, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.cp.group)
        start = sum(ctx.counts[: ctx.cp.rank])
        return grad[start : start + ctx.counts[ctx.cp.rank]], None, None


def gather_rows(rows: torch.Tensor, counts: list[int], cp: ContextParallel) -> torch.Tensor:
    return _GatherRows.apply(rows, counts, cp)


def _language_model_forward(
    module: nn.Module,
    cp: ContextParallel,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs: Any,
) -> MoeModelOutputWithPast:
    """Glm4vMoeTextModel.forward for training under CP: full-sequence mask, then the layers on this rank's slice.

    Takes what Glm4vMoeModel.forward hands its language model (the merged embeddings and the data pipeline's
    position ids [3, B, S], or [4, B, S] when packed) and returns this rank's slice of the last hidden state.
    """
    assert inputs_embeds is not None and position_ids is not None and position_ids.ndim == 3, "merged inputs expected"
    assert cache is None and not use_cache, "context parallelism trains without a KV cache"
    if position_ids.shape[0] == 4:  # packed: row 0 holds per-sample text positions, from which the mask is built
        text_position_ids, position_ids = position_ids[0], position_ids[1:]
    else:
        text_position_ids = None
    mask = create_causal_mask(
        config=module.config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=None,
        position_ids=text_position_ids,
    )
    hidden = cp.local(inputs_embeds, dim=1)
    position_ids = cp.local(position_ids, dim=2)
    position_embeddings = module.rotary_emb(hidden, position_ids)
    for layer in module.layers[: module.config.num_hidden_layers]:
        hidden = layer(
            hidden, position_embeddings=position_embeddings, attention_mask=mask, position_ids=position_ids, **kwargs
        )
    return MoeModelOutputWithPast(last_hidden_state=module.norm(hidden))


def pad_to_multiple(batch: dict, size: int, pad_token_id: int) -> dict:
    """Right-pad a collated batch's sequence dim to a multiple of `size` (pad id, mask 0, label -100).

    The padding sits after every real token of every row, so under the causal mask no real token sees it.
    """
    length = batch["input_ids"].shape[1]
    extra = -length % size
    if extra == 0:
        return batch
    padded = dict(batch)
    padded["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=pad_token_id)
    padded["labels"] = F.pad(batch["labels"], (0, extra), value=IGNORE_INDEX)
    padded["mm_token_type_ids"] = F.pad(batch["mm_token_type_ids"], (0, extra), value=0)
    if batch.get("attention_mask") is not None:
        padded["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=0)
    positions = F.pad(batch["position_ids"], (0, extra), value=0)
    if positions.shape[0] == 4:  # packed: the text positions run on, so the padding joins the last sample
        last = batch["position_ids"][0, :, -1:]
        positions[0, :, length:] = last + torch.arange(1, extra + 1, device=positions.device)
    padded["position_ids"] = positions
    return padded


def check_context_parallel(hf_config: Any, ulysses: int, kernel: str) -> None:
    """ConfigError when the model's heads or the attention kernel cannot be split `ulysses` ways."""
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
            f"Config key 'model.attn_implementation' = {kernel!r} is not supported with Ulysses context parallelism "
            f"(parallel.ulysses_parallel_size = {ulysses}) yet: its packed-sequence path reads per-rank position ids. "
            f"Set model.attn_implementation to one of {', '.join(CP_KERNELS)}."
        )


def apply_context_parallel(model: nn.Module, cp: ContextParallel) -> list[PlanMatch]:
    """The CP plan on the meta model (before FSDP): the language model runs this rank's slice of the sequence and
    every text attention module the Ulysses attention. Attaches `cp` to the model as `model.context_parallel`."""
    matches = match_modules(model, [LANGUAGE_MODEL], "parallel.ulysses_parallel_size")
    language_model = model.get_submodule(LANGUAGE_MODEL)
    language_model.forward = functools.partial(_language_model_forward, language_model, cp)
    attention_config = copy.copy(language_model.config)
    attention_config._attn_implementation = ULYSSES_ATTENTION
    for module in language_model.modules():
        if isinstance(module, Glm4vMoeTextAttention):
            module.config = attention_config
            module.context_parallel = cp
    model.context_parallel = cp
    return matches
