"""How a micro batch's sequence is laid out over the context-parallel (CP) ranks: one object for the padding, the
split, the label shift before it, the un-split, the vision tower's share of the images and the sum of the ranks'
partial figures.

The model's training forward (model/loss.py) asks its `sequence_layout` for each of these; without CP that is
`WholeSequence` (every rank holds whole sequences, everything is the identity). The CP plan installs a
`SplitSequence`: the batch is right-padded to a multiple of the CP size, and rank r keeps the contiguous slice r of
every sequence (tokens, rotary positions - all 3 or 4 rows - and the shifted labels) through the decoder layers, the
final norm and the loss. The labels are shifted on the whole sequence first, so a token whose target lies on the next
rank is still supervised, and the loss is normalised by the unsplit batch's supervised tokens on every rank.
Ring attention (and hybrid Ulysses x Ring) installs `ZigzagSequence` instead: the sequence is padded to a multiple of
2 x ring x ulysses and cut into 2 x ring chunks; ring rank i holds chunks i and 2r-1-i (so causal attention costs every
ring rank the same), and the Ulysses ranks of that ring rank split this block into contiguous slices.

Vision: each CP rank encodes a contiguous run of the micro batch's images (balanced by patches; a rank without one
runs the dummy image so the FSDP unit runs alike on every rank) and the features of all images are gathered, so every
rank merges the whole set into its copy of the embeddings; in backward each rank's partial feature gradients are
summed over the group before it keeps the rows it encoded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd

from glm45v_fsdp.model.loss import WholeSequence, encode_images, no_image_features
from glm45v_fsdp.vocab import IGNORE_INDEX


def pad_to_multiple(batch: dict, size: int, pad_token_id: int) -> dict:
    """Right-pad a collated batch's sequence dim to a multiple of `size` (pad id, label -100; position ids when the
    batch has them).

    The padding sits after every real token of every row, so under the causal mask no real token sees it; its
    attention mask is 1, not 0: a 0 would turn a batch without padding into one that needs an explicit
    [S, S] mask, which takes sdpa off its fused causal kernel onto one that saves S x S attention weights per layer
    (measured: 2.3x the peak memory at 3,000 tokens). The padding's own outputs are never used (label -100).
    """
    length = batch["input_ids"].shape[1]
    extra = -length % size
    if extra == 0:
        return batch
    padded = dict(batch)
    padded["input_ids"] = F.pad(batch["input_ids"], (0, extra), value=pad_token_id)
    for key in ("labels", "shift_labels"):  # a script's batch may bring its targets pre-shifted (shift_labels)
        if batch.get(key) is not None:
            padded[key] = F.pad(batch[key], (0, extra), value=IGNORE_INDEX)
    padded["mm_token_type_ids"] = F.pad(batch["mm_token_type_ids"], (0, extra), value=0)
    if batch.get("attention_mask") is not None:
        padded["attention_mask"] = F.pad(batch["attention_mask"], (0, extra), value=1)
    if batch.get("position_ids") is None:  # an HF collator's batch: the model derives the positions, padding included
        return padded
    positions = F.pad(batch["position_ids"], (0, extra), value=0)
    if positions.shape[0] == 4:  # packed: the text positions run on, so the padding joins the last sample
        last = batch["position_ids"][0, :, -1:]
        positions[0, :, length:] = last + torch.arange(1, extra + 1, device=positions.device)
    padded["position_ids"] = positions
    return padded


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
    def forward(ctx, rows: torch.Tensor, counts: list[int], layout: SplitSequence):
        ctx.counts, ctx.layout = counts, layout
        padded = rows.new_zeros(max(counts), *rows.shape[1:])
        padded[: rows.shape[0]] = rows
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded, group=layout.group)
        return torch.cat([part[:count] for part, count in zip(gathered, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.layout.group)
        start = sum(ctx.counts[: ctx.layout.rank])
        return grad[start : start + ctx.counts[ctx.layout.rank]], None, None


class SplitSequence(WholeSequence):
    """Every sequence split into `size` contiguous slices over the CP group; this rank (`rank`) holds slice `rank`."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int, pad_token_id: int) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.pad_token_id = pad_token_id

    @property
    def multiple(self) -> int:
        """Sequences are padded to a multiple of this."""
        return self.size

    def pad(self, batch: dict) -> dict:
        return pad_to_multiple(batch, self.multiple, self.pad_token_id)

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        chunk = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * chunk, chunk)

    def local_length(self, length: int) -> int:
        return (length + -length % self.multiple) // self.size

    def unshard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return all_gather_single_autograd(tensor.contiguous(), gather_dim=dim, group=self.group)

    def reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return _GatherRows.apply(rows, counts, self)

    def encode_images(self, model: nn.Module, batch: dict) -> object:
        if batch.get("pixel_values") is None:
            return no_image_features(model, batch["input_ids"].device)
        grid = batch["image_grid_thw"]
        patches = grid.prod(-1).tolist()
        owners = image_owners(patches, self.size)
        mine = [index for index, owner in enumerate(owners) if owner == self.rank]
        if mine:
            first, end = mine[0], mine[-1] + 1
            pixels = batch["pixel_values"][sum(patches[:first]) : sum(patches[:end])]
            outputs = encode_images(model, {"pixel_values": pixels, "image_grid_thw": grid[first:end]})
        else:
            outputs = no_image_features(model, batch["input_ids"].device)
        rows = torch.cat(outputs.pooler_output)
        merged = model.model.visual.spatial_merge_size**2
        counts = [sum(p // merged for p, owner in zip(patches, owners) if owner == rank) for rank in range(self.size)]
        outputs.pooler_output = (self.gather_rows(rows, counts),)
        return outputs

    def describe(self) -> str:
        return f"split into {self.size} contiguous slices (this rank: slice {self.rank})"


class ZigzagSequence(SplitSequence):
    """Load-balanced causal layout for Ring attention: 2r chunks, ring rank i holds chunks i and 2r-1-i (its ring
    block, in global order), split into `ulysses` contiguous slices over the Ulysses ranks (cp rank = ring rank x
    ulysses + ulysses rank, Ulysses innermost as in the mesh)."""

    def __init__(
        self, group: dist.ProcessGroup, ring: int, ring_rank: int, ulysses: int, ulysses_rank: int, pad_token_id: int
    ) -> None:
        super().__init__(group, ring * ulysses, ring_rank * ulysses + ulysses_rank, pad_token_id)
        self.ring, self.ring_rank = ring, ring_rank
        self.ulysses, self.ulysses_rank = ulysses, ulysses_rank

    @property
    def multiple(self) -> int:
        return 2 * self.size

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        chunks = tensor.chunk(2 * self.ring, dim)
        block = torch.cat([chunks[self.ring_rank], chunks[2 * self.ring - 1 - self.ring_rank]], dim)
        return block.chunk(self.ulysses, dim)[self.ulysses_rank]

    def unshard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        blocks = super().unshard(tensor, dim).chunk(self.ring, dim)  # ring block i = chunks (i, 2r-1-i)
        halves = [block.chunk(2, dim) for block in blocks]
        return torch.cat([half[0] for half in halves] + [half[1] for half in reversed(halves)], dim)

    def describe(self) -> str:
        return (
            f"zigzag: {2 * self.ring} chunks, ring rank {self.ring_rank} holds chunks {self.ring_rank} and "
            f"{2 * self.ring - 1 - self.ring_rank}, split over {self.ulysses} Ulysses rank(s)"
        )
