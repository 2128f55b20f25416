"""Shared types with no dependency on the rest of pdserve."""
