"""A worker's KV plumbing beyond its engine: transfer peers and write grants, the lower tiers' bytes, KV events."""
