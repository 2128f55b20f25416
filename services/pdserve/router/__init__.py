"""The router process: the OpenAI API (openai/) and routing across workers (routing/), joined by backend.py."""
