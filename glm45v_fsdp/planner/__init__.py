"""The layout planner's step-time model: FLOPs (flops.py) and collective bytes (traffic.py) of one training step
for a layout, over a device preset's rates (devices.py), put together in step_time.py; search.py enumerates the
layouts that fit by the memory estimator and ranks them. `python -m glm45v_fsdp.tools.plan` is the command line;
docs/planning.md states every term and assumption."""
