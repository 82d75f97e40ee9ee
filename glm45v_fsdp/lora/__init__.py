"""LoRA on the whole engine: low-rank adapters on the linear layers and on the routed experts' stacks (a grouped GEMM
per expert group), applied as one plan on the meta-device model, and PEFT's adapter format read and written.

- `layers`: `LoraLinear` (an nn.Linear with its adapter) and the experts' adapter stacks;
- `apply`: the lora plan's work: which modules get adapters (from `model.lora` or a PEFT model), the base frozen;
- `peft_format`: `adapter_config.json` + `adapter_model.safetensors` with PEFT's key names, both ways.
"""
