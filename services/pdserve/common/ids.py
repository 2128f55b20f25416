"""Distinct id types, so mixed-up arguments show at review time."""
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest naming a full block's content and its whole prefix."""

BlockId = NewType("BlockId", int)
"""Index of a physical block in one worker's KV tensor."""

RequestId = NewType("RequestId", str)
DeploymentId = NewType("DeploymentId", str)
"""One launch of a router and its workers; a router admits only workers of its own (when it has one)."""

WorkerId = NewType("WorkerId", str)
