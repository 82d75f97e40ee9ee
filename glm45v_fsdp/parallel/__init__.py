"""Parallel plans: module patterns, FSDP2 sharding, (later) expert and context parallelism."""
