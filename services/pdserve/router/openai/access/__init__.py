"""Who may call the API (keys, `guard`) and which KV cache each caller sees (`tenants`)."""
