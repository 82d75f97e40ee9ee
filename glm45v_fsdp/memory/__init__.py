"""Memory features applied as plans on the meta model: chunked loss (recompute and activation offload to come)."""
