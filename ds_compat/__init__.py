"""DeepSpeed compatibility layer for the glm45v-fsdp engine (ds_config.json, launcher, engine API).

Nothing is exported yet: the translation layer lands with the DeepSpeed compatibility issue.
"""
