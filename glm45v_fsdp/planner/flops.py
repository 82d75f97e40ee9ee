"""FLOPs of one training step per rank, from the model's parameter shapes and the tokens each rank processes.

A weight matrix W applied to r rows costs 2 r |W| multiply-adds in forward (a convolution counts as the matmul over
its patches); the planner walks the meta model's parameters (every one with 2 or more dims) and gives each the rows
it sees on one rank:
  vision patch embedding and blocks     P   image patches per rank (whole images: CP splits images, not patches)
  vision downsample and merger          M = P / merge^2 merged image tokens
  text layers (attention, dense MLP, router, shared expert), lm_head
                                        s   tokens per rank = micro batch x tokens per sample / cp
  routed experts [E, ...]               s k / E per expert (k = top-k: every token's k pairs; balanced experts)
  embeddings, position tables           0   (lookups)
Attention scores and the weighted sum: 4 S^2 a d x causal per sample of S tokens (a heads of dim d), / cp per rank
(Ulysses gives each rank a/cp heads of the whole sequence, Ring 1/cp of the blocks); `causal` is the share of the
S x S scores a kernel computes: 0.5 for kernels that skip masked blocks (flash attention, the ring's zigzag
blocks), 1.0 for what torch.utils.flop_counter counts (it does not look at the mask). Vision attention is full
within each image: 4 n^2 h_v per image of n patches. A rank with no image in its micro batch runs the tower on a
one-token dummy image (merge^2 patches), so that every rank's FSDP collectives line up.
Backward: 2 x forward (gradients of inputs and of weights), less the patch embedding's input gradient (the pixels
need none). Recompute: full replays the forward of the matched
modules (decoder layers, vision blocks) in backward, less the attention kernel with keep_attention and less each
MLP's down projection: torch's non-reentrant checkpoint stops the replay once every tensor backward needs exists
again, and a down projection's output only feeds the residual sum (the routed experts' output does not: the
combine multiplies it by the routing weights, so it is replayed); selective keeps
every matmul output and recomputes only element-wise work (0 FLOPs here). The chunked loss computes the same lm_head
matmuls (its gradients in forward, none in backward): no change. Element-wise work (norms, activations, softmax,
the optimizer) is not counted: it is bound by memory, and the step-time model counts the optimizer separately.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from torch import nn

NOT_REPLAYED = (".mlp.down_proj.", ".shared_experts.down_proj.")  # last matmuls before a residual sum


@dataclass(frozen=True)
class Shape:
    """What one rank processes per micro batch."""

    tokens: int  # s: text tokens per rank (image tokens included)
    sample_tokens: int  # S: tokens of one whole sample (before CP)
    samples: int  # samples per micro batch
    cp: int
    patches: int  # P: image patches per rank
    image_patches: list[int] = field(default_factory=list)  # patches of each image this rank encodes


@dataclass
class Flops:
    """Forward FLOPs per micro batch per rank by term, and what backward and recompute add."""

    forward: dict[str, float]
    backward: float
    recompute: float = 0.0

    @property
    def forward_total(self) -> float:
        return sum(self.forward.values())

    @property
    def total(self) -> float:
        """Forward + backward + recomputed forward, per micro batch."""
        return self.forward_total + self.backward + self.recompute


def _rows(name: str, shape: Shape, merge: int, top_k: int, experts: int) -> float:
    if name.startswith("model.language_model.embed_tokens") or "position_embedding" in name:
        return 0
    if name.startswith("model.visual."):
        if name.startswith(("model.visual.downsample", "model.visual.merger")):
            return shape.patches / merge**2
        return shape.patches
    if ".mlp.experts." in name:
        return shape.tokens * top_k / experts
    return shape.tokens


def attention_flops(hf_config: object, shape: Shape, causal: float) -> tuple[float, float]:
    """(text, vision) attention-kernel FLOPs per micro batch per rank."""
    text, vision = hf_config.text_config, hf_config.vision_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_sample = 4 * shape.sample_tokens**2 * text.num_attention_heads * head_dim * causal
    text_flops = text.num_hidden_layers * per_sample * shape.samples / shape.cp
    vision_flops = vision.depth * sum(4 * n**2 * vision.hidden_size for n in shape.image_patches)
    return text_flops, vision_flops


def step_flops(
    model: nn.Module,
    hf_config: object,
    shape: Shape,
    causal: float,
    recompute: str = "off",
    recompute_modules: list[str] = (),
    keep_attention: bool = True,
) -> Flops:
    """FLOPs per micro batch per rank for the meta (or real) `model`; `recompute_modules` are the modules the
    recompute plan matched (their forward runs again under full recompute)."""
    text, vision = hf_config.text_config, hf_config.vision_config
    merge = vision.spatial_merge_size
    if not shape.image_patches:  # the tower runs on a one-token dummy image (model/loss.py: no_image_features)
        shape = dataclasses.replace(shape, patches=merge**2, image_patches=[merge**2])
    forward = {"vision matmuls": 0.0, "text matmuls": 0.0, "routed experts": 0.0, "lm_head": 0.0}
    replayed = no_input_grad = 0.0
    prefixes = tuple(f"{name}." for name in recompute_modules)
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        rows = _rows(name, shape, merge, text.num_experts_per_tok, text.n_routed_experts)
        flops = 2 * rows * math.prod(param.shape)
        if name.startswith("model.visual."):
            forward["vision matmuls"] += flops
        elif ".mlp.experts." in name:
            forward["routed experts"] += flops
        elif name.startswith("lm_head"):
            forward["lm_head"] += flops
        else:
            forward["text matmuls"] += flops
        if name.startswith(prefixes) and not any(part in name for part in NOT_REPLAYED):
            replayed += flops
        if name.startswith("model.visual.patch_embed"):
            no_input_grad += flops
    text_attention, vision_attention = attention_flops(hf_config, shape, causal)
    forward["text attention"] = text_attention
    forward["vision attention"] = vision_attention
    if recompute == "full":
        layers = [n for n in recompute_modules if n.startswith("model.language_model.layers.")]
        blocks = [n for n in recompute_modules if n.startswith("model.visual.blocks.")]
        if not keep_attention:
            replayed += text_attention * len(layers) / text.num_hidden_layers
            replayed += vision_attention * len(blocks) / max(1, vision.depth)
    else:
        replayed = 0.0
    return Flops(forward, 2 * sum(forward.values()) - no_input_grad, replayed)
