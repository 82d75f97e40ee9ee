"""`deepspeed.runtime.sequence_parallel`: DeepSpeed's ALST names (Ulysses sequence parallelism for HF models) on this
backend's context parallelism; see `ulysses_sp` and docs/ds_compat.md "Long sequences: DeepSpeed's ALST names"."""
