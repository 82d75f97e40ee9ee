"""Accelerator ops: one layer that picks, per device, the kernel each op of GLM-4.5V runs.

  registry.py   the implementations of each op, `model.ops` resolved per device (`choose_ops`), the log line
  reference.py  plain PyTorch references, equal to transformers' modules
  kernels.py    the fast kernels: torch_npu's fused ops (NPU), flash-attn varlen (CUDA), torch._grouped_mm
  verify.py     every chosen fast kernel's first call against the reference, before training
  apply.py      the kernels put into the meta-device model (the `ops` plan), module and parameter names kept

See docs/runtime.md ("Accelerator ops") for what runs where and what is unverified on hardware.
"""
