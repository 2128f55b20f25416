"""Speculative decoding: the settings, and the proposers that draft tokens for the target to verify."""
