"""DeepSpeed compatibility layer for the glm45v-fsdp engine.

Available: `ds_compat.config` (ds_config.json translation, `python -m ds_compat.config explain`) and
`ds_compat.launcher` (the `ds-fsdp` launcher with the deepspeed launcher's flags). The engine API
(`import ds_compat as deepspeed`; initialize, engine.backward/step/save_checkpoint) is not implemented yet.
"""
