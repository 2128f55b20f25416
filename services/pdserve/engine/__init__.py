"""Model forward over the paged KV cache, scheduler and sampler (torch)."""
