"""Put the chosen kernels into the meta-device model, keeping every module path and parameter name.

A module whose op runs a fast kernel gets a subclass of its own class (as FSDP2 does with FSDPModule): the same
parameters and buffers, a forward that calls the kernel. What is swapped, per op:

  rms_norm   Glm4vMoeTextRMSNorm, Glm4vMoeRMSNorm (vision)                   -> forward: the kernel
  rotary     Glm4vMoeTextAttention, Glm4vMoeVisionAttention                   -> rotary through the kernel
  attention  the same two attention modules                                  -> attention through the kernel: text
             causal, packed rows as varlen (the boundaries from the batch's cu_seqlens, see model/loss.py), vision
             as varlen over the images (its own cu_seqlens); under context parallelism the text attention stays
             the context-parallel one
  swiglu     Glm4vMoeTextMLP (dense layers, shared experts), the vision MLP   -> silu(gate) * up through the kernel
             (gate and up concatenated); the routed experts' gate_up output directly
  experts    GroupedExperts of our MoE block                                 -> its grouped GEMM
  permute    the MoE block's LocalDispatcher                                  -> its permute / unpermute
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.glm4v_moe import modeling_glm4v_moe as hf

from glm45v_fsdp.model.moe import LocalDispatcher, MoEBlock
from glm45v_fsdp.module_patterns import PlanMatch
from glm45v_fsdp.ops.kernels import KERNELS
from glm45v_fsdp.ops.registry import OpsChoice

OPS_ATTENTION = "glm45v_ops"
SILU = (
    nn.SiLU,
    type(ACT2FN["silu"]),
)  # the text attention modules' own config names it while the kernel runs attention


class _OpsModule:
    """Mixin of the swapped classes: the kernels it calls live on the instance."""

    ops_kernels: dict[str, Any]


class OpsRMSNorm(_OpsModule):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.ops_kernels["rms_norm"](hidden_states, self.weight, self.variance_epsilon)


class OpsMLP(_OpsModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
        return self.down_proj(self.ops_kernels["swiglu"](gate_up))


class OpsTextAttention(_OpsModule):
    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        assert cache is None, "training runs without a KV cache"
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query, key = _rotate(self.ops_kernels, "text", query, key, *position_embeddings)
        if self.config._attn_implementation == OPS_ATTENTION:
            output, _ = self.ops_kernels["attention"](
                query,
                key,
                value,
                causal=True,
                scale=self.scaling,
                cu_seqlens=kwargs.get("ops_cu_seqlens"),
                seqlens=kwargs.get("ops_seqlens"),
            )
        else:  # transformers' attention, or context parallelism's
            interface = _interface(self.config)
            output, _ = interface(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), None


class OpsVisionAttention(_OpsModule):
    def forward(self, hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, **kwargs):
        length = hidden_states.shape[0]
        query, key, value = self.qkv(hidden_states).reshape(length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        query, key = _rotate(self.ops_kernels, "vision", query, key, *position_embeddings)
        attention = self.ops_kernels.get("attention")
        if attention is None:
            return self._transformers_attention(hidden_states, query, key, value, cu_seqlens)
        bnsd = [t.transpose(0, 1)[None] for t in (query, key, value)]
        output, _ = attention(
            *bnsd, causal=False, scale=self.scaling, cu_seqlens=cu_seqlens, seqlens=cu_seqlens.tolist()
        )
        return self.proj(output.reshape(length, -1).contiguous())

    def _transformers_attention(self, hidden_states, query, key, value, cu_seqlens):
        """transformers' own per-image loop over the configured attention (only the rotary was swapped)."""
        interface = _interface(self.config)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        splits = [torch.split(t.transpose(0, 1).unsqueeze(0), lengths, dim=2) for t in (query, key, value)]
        outputs = [
            interface(self, q, k, v, attention_mask=None, scaling=self.scaling, dropout=0.0, is_causal=False)[0]
            for q, k, v in zip(*splits)
        ]
        return self.proj(torch.cat(outputs, dim=1).reshape(hidden_states.shape[0], -1).contiguous())


def _rotate(kernels: dict[str, Any], kind: str, query, key, cos, sin):
    """Rotary through the kernel, or transformers' own function for `kind` (text / vision)."""
    if "rotary" in kernels:
        return getattr(kernels["rotary"], kind)(query, key, cos, sin)
    own = hf.apply_rotary_pos_emb if kind == "text" else hf.apply_rotary_pos_emb_vision
    return own(query, key, cos, sin)


def _interface(config: Any) -> Callable:
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, hf.eager_attention_forward)


def _swap(module: nn.Module, mixin: type, kernels: dict[str, Any]) -> None:
    base = type(module)
    if not isinstance(module, mixin):
        module.__class__ = type(f"{mixin.__name__}[{base.__name__}]", (mixin, base), {})
    module.ops_kernels = kernels


def kernels_of(choice: OpsChoice) -> dict[str, Any]:
    """{op: kernel} of the ops that do not run their reference."""
    return {op: KERNELS[(op, choice.names[op])] for op in choice.fast()}


def apply_ops(model: nn.Module, choice: OpsChoice) -> list[PlanMatch]:
    """Swap the modules each fast op runs in (see the module docstring); one PlanMatch per fast op, naming the
    modules that now call its kernel. Each fast op must reach at least one module (asserted by the plan)."""
    kernels = kernels_of(choice)
    reached: dict[str, list[str]] = {op: [] for op in kernels}
    for name, module in model.named_modules():
        if isinstance(module, (hf.Glm4vMoeTextRMSNorm, hf.Glm4vMoeRMSNorm)) and "rms_norm" in kernels:
            _swap(module, OpsRMSNorm, kernels)
            reached["rms_norm"].append(name)
        elif isinstance(module, hf.Glm4vMoeTextAttention) and {"rotary", "attention"} & kernels.keys():
            _swap(module, OpsTextAttention, kernels)
            if "attention" in kernels:
                module.config = _config_naming(module.config, OPS_ATTENTION)
            reached.update({op: reached[op] + [name] for op in ("rotary", "attention") if op in kernels})
        elif isinstance(module, hf.Glm4vMoeVisionAttention) and {"rotary", "attention"} & kernels.keys():
            _swap(module, OpsVisionAttention, kernels)
            reached.update({op: reached[op] + [name] for op in ("rotary", "attention") if op in kernels})
        elif isinstance(module, (hf.Glm4vMoeTextMLP, hf.Glm4vMoeisionMlp)) and "swiglu" in kernels:
            assert isinstance(module.act_fn, SILU), f"{name}: swiglu needs silu, not {module.act_fn}"
            _swap(module, OpsMLP, kernels)
            reached["swiglu"].append(name)
        elif isinstance(module, MoEBlock):
            if "experts" in kernels:
                module.experts.use_kernels(choice.names["experts"], kernels["experts"], kernels.get("swiglu"))
                reached["experts"].append(f"{name}.experts")
                if "swiglu" in kernels:
                    reached["swiglu"].append(f"{name}.experts")
            if "permute" in kernels:
                assert isinstance(module.dispatcher, LocalDispatcher), "ops come before expert parallelism"
                module.dispatcher = LocalDispatcher(module.gate.num_experts, permute=kernels["permute"])
                reached["permute"].append(f"{name}.dispatcher")
    return [PlanMatch(f"{op}: {choice.label(op)}", tuple(names)) for op, names in reached.items()]


def _config_naming(config: Any, implementation: str) -> Any:
    """A copy of `config` whose attention implementation is `implementation` (the module's own, as CP does)."""
    own = copy.copy(config)
    own._attn_implementation = implementation
    return own
