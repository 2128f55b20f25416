"""Structured output and tool calling: guides from request fields, tool plans, tool-call parsing."""
