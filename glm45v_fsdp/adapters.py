"""The adapter layers. Their semantics are PEFT's (peft.tuners.lora): an adapted weight W [out, in] computes
x W^T + scaling * (dropout(x) A^T) B^T with A [r, in], B [out, r], scaling = alpha / r.

- `LoraLinear` is an nn.Linear whose `weight` / `bias` keep their names (HF loading, DCP and FSDP see the base
  unchanged) and which holds `lora_A` [r, in] and `lora_B` [out, r] beside them.
- The routed experts keep their stacks `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I] and get, per stack,
  `<stack>_lora_A` [E, r, in] and `<stack>_lora_B` [E, out, r]: expert e computes x W_e^T + s (x A_e^T) B_e^T, two
  thin grouped GEMMs over the same row groups as the base's (never W + BA merged into a fresh stack). The stacks
  are [E, ...] like the base's, so expert parallelism shards them on dim 0 with the base: each EP rank holds the
  adapters of its own experts. PEFT's ParamWrapper stores the same factors as A [r*E, in], B [out, r*E]
  (`lora/peft_format.py` converts).

Beside the model package, not in lora/ (docs/architecture.md, "Floors"): the MoE block runs the experts' adapter stacks,
the init fills them and the checkpoints tell adapter tensors by name (`is_adapter`), while the lora plan (lora/apply.py)
puts the layers in. Importing this module loads no model (no transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_MARKERS = ("lora_A", "lora_B")
GEMM_ALIGN_BYTES = 16  # a grouped GEMM's operands need strides in multiples of 16 bytes (torch._grouped_mm, cuBLAS)


def is_adapter(name: str) -> bool:
    """Whether a parameter name (`...q_proj.lora_A`, `...experts.gate_up_proj_lora_B`) is an adapter's."""
    leaf = name.rpartition(".")[2]
    return any(leaf == marker or leaf.endswith(f"_{marker}") for marker in ADAPTER_MARKERS)


class LoraLinear(nn.Linear):
    """nn.Linear + a LoRA adapter (built on the meta device in place of the linear it adapts)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        with torch.device("meta"):
            super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
            self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
            self.lora_B = nn.Parameter(torch.empty(base.out_features, rank))
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.scaling = rank, alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + update * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora rank={self.rank}, scaling={self.scaling:g}"


def add_expert_adapters(experts: nn.Module, stacks: dict[str, tuple[int, float]]) -> None:
    """Register `<stack>_lora_A` [E, r, in] / `<stack>_lora_B` [E, out, r] on the grouped experts (meta device) for
    each stack name -> (rank, alpha), and their scalings in `experts.adapter_scaling`."""
    scaling = {}
    for stack, (rank, alpha) in stacks.items():
        num_experts, out_features, in_features = getattr(experts, stack).shape
        with torch.device("meta"):
            experts.register_parameter(f"{stack}_lora_A", nn.Parameter(torch.empty(num_experts, rank, in_features)))
            experts.register_parameter(f"{stack}_lora_B", nn.Parameter(torch.empty(num_experts, out_features, rank)))
        scaling[stack] = alpha / rank
    experts.adapter_scaling = scaling


def grouped_update(rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, counts: torch.Tensor, gemm):
    """s-less low-rank update of each expert's rows: (rows_e A_e^T) B_e^T per group, with the experts' grouped GEMM
    `gemm(rows, weight, counts)`, or per expert (the reference loop) when `gemm` is None. The factors take the rows'
    dtype (a one-rank bf16 run keeps its frozen base in bf16 and its fp32 adapters unsharded, under autocast)."""
    lora_a, lora_b = lora_a.to(rows.dtype), lora_b.to(rows.dtype)
    if gemm is not None:
        pad = -lora_a.shape[1] % (GEMM_ALIGN_BYTES // lora_a.element_size())
        if pad:  # zero rank rows / columns: the same update, with the strides a grouped GEMM needs
            lora_a, lora_b = F.pad(lora_a, (0, 0, 0, pad)), F.pad(lora_b, (0, pad))
        low = gemm(rows, lora_a, counts)
        return gemm(low, lora_b.to(low.dtype), counts)
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            outputs.append(F.linear(F.linear(rows[start : start + count], lora_a[expert]), lora_b[expert]))
            start += count
    if not outputs:  # no row: still reach the adapters, so every rank's backward yields a (zero) gradient
        return F.linear(F.linear(rows, lora_a[0]), lora_b[0])
    return torch.cat(outputs)
