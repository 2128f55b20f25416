"""The OpenAI-compatible HTTP API: it knows requests and responses, not workers (those are behind router.backend)."""
