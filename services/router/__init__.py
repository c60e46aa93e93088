"""Router: OpenAI-compatible HTTP API and the global scheduler."""
