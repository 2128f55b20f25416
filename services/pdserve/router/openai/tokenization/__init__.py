"""vLLM's routes around the generation API: `/tokenize`, `/detokenize`, `/version` (`routes`)."""
