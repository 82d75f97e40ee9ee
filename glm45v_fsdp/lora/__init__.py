"""LoRA on the whole engine: low-rank adapters on the linear layers and on the routed experts' stacks (a grouped GEMM
per expert group), applied as one plan on the meta-device model, and PEFT's adapter format read and written.

- `apply`: the lora plan's work: which modules get adapters (from `model.lora` or a PEFT model), the base frozen;
- `peft_format`: `adapter_config.json` + `adapter_model.safetensors` with PEFT's key names, both ways.

The adapter layers themselves (`LoraLinear`, the experts' adapter stacks and their grouped-GEMM update) are
glm45v_fsdp/adapters.py, beside the model that runs them.
"""
