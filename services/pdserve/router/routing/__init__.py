"""Routing across workers: which worker serves a request, and why; it knows workers and KV, not HTTP."""
