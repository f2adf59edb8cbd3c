"""The HTTP server: ``AsyncEngine`` (the engine loop on its own thread), the
OpenAI- and Anthropic-shaped endpoints, errors, metrics, and ``engine serve``."""
