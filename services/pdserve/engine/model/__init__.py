"""The model math: the decoder over the paged KV tensor, attention, sampling, and the runner that runs one step."""
