"""A PEFT LoRA model that a script built (`get_peft_model`, `PeftModel.from_pretrained`), taken apart for the plan
registry: its transformers base model with every LoRA layer replaced by the layer it wraps, the adapters as an
`AdapterSpec` (each layer's own rank, scaling and dropout, as PEFT built it), their values in our layout, which
parameters train, and the map between PEFT's parameter names and ours.

PEFT's in-memory names put `.base_layer` between an adapted module and what it wraps, and `.<adapter>.weight` after
each factor (`...q_proj.lora_A.default.weight`); a routed-experts stack's factors are flat (peft_format). The PEFT
model object stays what the script holds: its `base_model.model` is the model the plans rebuild in place, and
`PeftNames` renames the state dicts that leave or enter it, so `save_pretrained` and `set_peft_model_state_dict` see
PEFT's keys. Only what is imported here is PEFT's: nothing of it runs in training.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.lora.apply import EXPERT_STACKS, AdapterSpec, LinearAdapter
from glm45v_fsdp.lora.peft_format import WEIGHTS_FILE, from_peft, to_peft

SHELL_PREFIX = "base_model.model."  # the transformers model inside a PeftModel


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT model (PeftModel and its task subclasses), told by its class's package: PEFT need not be installed."""
    return type(model).__module__.split(".")[0] == "peft" and hasattr(model, "get_base_model")


def peft_base_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a PEFT model whose adapter is LoRA; None for anything else."""
    if not is_peft_model(model):
        return None
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", None))
    if config is None or str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"):
        return None
    return model.get_base_model()


@dataclass(frozen=True)
class PeftAdapters:
    """What `take_adapters` read from a PEFT model."""

    spec: AdapterSpec
    parameters: dict[str, nn.Parameter]  # our adapter name (in the base model) -> PEFT's parameter (its layout)
    names: PeftNames

    def our_value(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """PEFT's full tensor of adapter `name` in our layout."""
        return from_peft(name, tensor, self.names.stack_experts.get(SHELL_PREFIX + name, 0))

    def describe(self) -> str:
        return f"PEFT LoRA adapter '{self.names.adapter}' on {self.spec.counts()}"


class PeftNames:
    """PEFT's state-dict keys <-> ours, for the PEFT model object (keys under `base_model.model.`)."""

    def __init__(
        self, adapter: str, ours_to_peft: dict[str, str], stack_experts: dict[str, int], adapter_keys: list[str]
    ) -> None:
        self.adapter = adapter
        self.ours_to_peft = ours_to_peft
        self.peft_to_ours = {peft: ours for ours, peft in ours_to_peft.items()}
        self.stack_experts = stack_experts  # by our key
        self.adapter_keys = adapter_keys  # PEFT's keys of the adapters' factors
        self.active = True  # False: the model's state dicts in our names (the engine's own checkpoint code)

    def ours(self, peft_key: str) -> str:
        return self.peft_to_ours.get(peft_key, peft_key)

    def to_peft(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict of the PEFT model in our names and layouts -> PEFT's (full tensors for the stacks)."""
        renamed = {}
        for key, value in state.items():
            if key in self.stack_experts and torch.is_tensor(value):
                value = to_peft(key, _full(value))
            renamed[self.ours_to_peft.get(key, key)] = value
        return renamed

    def from_peft(self, state: dict[str, torch.Tensor]) -> None:
        """In place: PEFT's keys and layouts -> ours (what `load_state_dict` of the PEFT model is given)."""
        for key in [key for key in state if key in self.peft_to_ours]:
            ours = self.peft_to_ours[key]
            value = state.pop(key)
            if ours in self.stack_experts and torch.is_tensor(value):
                value = from_peft(ours, value, self.stack_experts[ours])
            state[ours] = value


NAMES_ATTRIBUTE = "_glm45v_peft_names"


def keep_peft_names(model: nn.Module, names: PeftNames) -> None:
    """The PEFT model `model`, whose base the plans rebuilt, keeps PEFT's view of itself: `state_dict()` and
    `load_state_dict()` in PEFT's keys and layouts (while `names.active`), and a `save_pretrained` that writes PEFT's
    files (PEFT's own finds the adapters by visiting its LoRA layers, which are gone)."""
    setattr(model, NAMES_ATTRIBUTE, names)
    model.register_state_dict_post_hook(functools.partial(_to_peft_hook, names))
    model.register_load_state_dict_pre_hook(functools.partial(_from_peft_hook, names))
    model.save_pretrained = functools.partial(save_pretrained, model, names)


def peft_names_of(model: nn.Module) -> PeftNames | None:
    return getattr(model, NAMES_ATTRIBUTE, None)


def _to_peft_hook(names: PeftNames, module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    if names.active:
        ours = {key[len(prefix) :]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
        state_dict.update({prefix + key: value for key, value in names.to_peft(ours).items()})


def _from_peft_hook(names: PeftNames, module: nn.Module, state_dict: dict, prefix: str, *_: Any) -> None:
    if names.active:
        given = {key[len(prefix) :]: state_dict.pop(key) for key in [k for k in state_dict if k.startswith(prefix)]}
        names.from_peft(given)
        state_dict.update({prefix + key: value for key, value in given.items()})


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def take_adapters(model: nn.Module) -> PeftAdapters:
    """Unwrap the PEFT LoRA model `model` in place: each LoRA layer of its base model is replaced by the layer it
    wraps (so the base is transformers' model again) and its adapters are returned with their values. Refuses what
    the adapter layers here do not compute as PEFT does."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear as PeftLinear
    from peft.tuners.lora.layer import ParamWrapper

    adapter = _single_adapter(model)
    base = model.get_base_model()
    peft_names = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    trained_ids = {id(p) for p in model.parameters() if p.requires_grad}
    lora_layers = {name for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    _refuse_wrappers(base, lora_layers)

    linear: dict[str, LinearAdapter] = {}
    experts: dict[str, dict[str, LinearAdapter]] = {}
    parameters: dict[str, nn.Parameter] = {}
    stack_experts: dict[str, int] = {}
    for name in sorted(lora_layers):
        if _inside(name, lora_layers):
            continue  # a ParamWrapper nested in another: taken with the outermost
        inner = base.get_submodule(name)
        while isinstance(inner, LoraLayer):
            stack = inner.parameter_name if isinstance(inner, ParamWrapper) else None
            if stack is None and not (isinstance(inner, PeftLinear) and type(inner.base_layer) is nn.Linear):
                raise UserError(
                    f"The PEFT model passed to deepspeed.initialize adapts '{name}' with a {type(inner).__name__} "
                    f"over a {type(inner.base_layer).__name__}: this backend runs LoRA on nn.Linear layers and on the "
                    f"routed experts' stacks (target_parameters) only. Leave '{name.rpartition('.')[2]}' out of "
                    f"target_modules."
                )
            if stack is not None and stack not in EXPERT_STACKS:
                raise UserError(
                    f"The PEFT model's target_parameters adapt '{name}.{stack}': the routed experts' adapters here "
                    f"are on {' and '.join(EXPERT_STACKS)}. Target those stacks."
                )
            _check_layer(name, inner, adapter)
            a, b = inner.lora_A[adapter].weight, inner.lora_B[adapter].weight
            rank = inner.r[adapter]  # alpha as our layers take it: scaling * r (rsLoRA's alpha / sqrt(r) too)
            settings = LinearAdapter(rank, inner.scaling[adapter] * rank, _dropout(inner, adapter))
            if stack is not None:
                experts.setdefault(name, {})[stack] = settings
                for factor, tensor in (("A", a), ("B", b)):
                    ours = f"{name}.{stack}_lora_{factor}"
                    parameters[ours], stack_experts[ours] = tensor, inner.num_experts
            else:
                linear[name] = settings
                parameters[f"{name}.lora_A"], parameters[f"{name}.lora_B"] = a, b
            inner = inner.base_layer
        parent, _, attribute = name.rpartition(".")
        setattr(base.get_submodule(parent), attribute, inner)

    ours_to_peft: dict[str, str] = {}
    for ours, tensor in [*base.named_parameters(), *base.named_buffers()]:
        if id(tensor) in peft_names:
            ours_to_peft[SHELL_PREFIX + ours] = peft_names[id(tensor)]
    for ours, tensor in parameters.items():
        ours_to_peft[SHELL_PREFIX + ours] = peft_names[id(tensor)]
    trained = frozenset(
        [ours for ours, p in base.named_parameters() if id(p) in trained_ids]
        + [ours for ours, p in parameters.items() if id(p) in trained_ids]
    )
    shell_stacks = {SHELL_PREFIX + ours: count for ours, count in stack_experts.items()}
    adapter_keys = [ours_to_peft[SHELL_PREFIX + ours] for ours in parameters]
    return PeftAdapters(
        AdapterSpec(linear, experts, trained=trained),
        parameters,
        PeftNames(adapter, ours_to_peft, shell_stacks, adapter_keys),
    )


def save_pretrained(
    model: nn.Module,
    names: PeftNames,
    save_directory: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    is_main_process: bool = True,
    **_: Any,
) -> None:
    """`PeftModel.save_pretrained` for a PEFT model whose LoRA layers the lora plan rebuilt (PEFT finds the tensors to
    save by visiting its own LoRA layers, which are gone): the same two files, `adapter_config.json` (the model's own
    LoraConfig) and `adapter_model.safetensors` with PEFT's keys. `state_dict`: the model's, in PEFT's keys (the
    consolidated one under ZeRO 3, as the HF Trainer passes); None: `model.state_dict()`, then every rank must call
    (each stack is gathered)."""
    state = model.state_dict() if state_dict is None else state_dict
    suffix = f".{names.adapter}."
    tensors = {
        key.replace(suffix, "."): _full(state[key]).detach().cpu().contiguous()
        for key in names.adapter_keys
        if key in state
    }
    if not is_main_process:
        return
    missing = [key for key in names.adapter_keys if key not in state]
    assert not missing, f"the state dict lacks the adapter's tensors {missing[:3]}"
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
    config = copy.deepcopy(model.peft_config[names.adapter])
    config.inference_mode = True
    config.save_pretrained(str(directory))


def _single_adapter(model: nn.Module) -> str:
    names = list(model.peft_config)
    if len(names) != 1:
        raise UserError(
            f"The PEFT model passed to deepspeed.initialize holds {len(names)} adapters ({', '.join(names)}); this "
            f"backend trains one. Delete the others (delete_adapter) before initialize."
        )
    config = model.peft_config[names[0]]
    refused = {
        "use_dora": "DoRA",
        "lora_bias": "lora_bias",
        "fan_in_fan_out": "fan_in_fan_out",
        "trainable_token_indices": "trainable_token_indices",
        "modules_to_save": "modules_to_save",
    }
    for key, what in refused.items():
        if getattr(config, key, None):
            raise UserError(
                f"The PEFT model passed to deepspeed.initialize has LoraConfig {key}={getattr(config, key)!r}: "
                f"{what} is not supported by this backend's LoRA plan (docs/lora.md). Remove it from the LoraConfig, "
                f"or train the model in full instead of the module."
            )
    return names[0]


def _check_layer(name: str, layer: nn.Module, adapter: str) -> None:
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        raise UserError(
            f"The PEFT model passed to deepspeed.initialize has its adapter on '{name}' "
            f"{'merged into the base weight' if layer.merged else 'disabled'}: train it unmerged and enabled "
            f"(unmerge_adapter() / enable_adapter_layers() before initialize)."
        )
    assert adapter in layer.lora_A, f"PEFT layer {name} lacks adapter {adapter}"


def _dropout(layer: nn.Module, adapter: str) -> float:
    dropout = layer.lora_dropout[adapter]
    return float(dropout.p) if isinstance(dropout, nn.Dropout) else 0.0


def _inside(name: str, layers: set[str]) -> bool:
    """Whether module `name` lies inside one of the modules `layers` (a LoRA layer's own parts, a nested wrapper)."""
    parts = name.split(".")
    return any(".".join(parts[:end]) in layers for end in range(1, len(parts)))


def _refuse_wrappers(base: nn.Module, lora_layers: set[str]) -> None:
    """PEFT wrappers other than LoRA layers (modules_to_save copies, trainable tokens): not taken apart here."""
    for name, module in base.named_modules():
        if name in lora_layers or _inside(name, lora_layers):
            continue
        if type(module).__module__.split(".")[0] == "peft":
            raise UserError(
                f"The PEFT model passed to deepspeed.initialize wraps '{name}' in PEFT's {type(module).__name__}: this "
                f"backend takes LoRA layers only (no modules_to_save or trainable tokens yet, docs/lora.md). Remove it "
                f"from the LoraConfig."
            )
