"""Checkpoints: HF safetensors in (per-rank slices, both expert layouts, strict) and out, the key layout they share
(docs/weights.md), and DCP save/resume of training runs."""

# DCP save / resume of training runs (checkpoint/dcp.py, state.py; docs/checkpoints.md), HF weights and the key
# layout (checkpoint/hf.py, hf_export.py, layout.py)
from glm45v_fsdp.checkpoint.dcp import Checkpointer, LoadSource, find_checkpoint, load_checkpoint, resolve_load
from glm45v_fsdp.checkpoint.hf import LoadReport, detect_format, load_hf_weights
from glm45v_fsdp.checkpoint.hf_export import export_hf
from glm45v_fsdp.checkpoint.layout import EXPERT_LAYOUTS, detect_expert_layout, model_to_hub_tensors

__all__ = [
    "EXPERT_LAYOUTS",
    "Checkpointer",
    "LoadReport",
    "LoadSource",
    "detect_expert_layout",
    "detect_format",
    "export_hf",
    "find_checkpoint",
    "load_checkpoint",
    "load_hf_weights",
    "model_to_hub_tensors",
    "resolve_load",
]
