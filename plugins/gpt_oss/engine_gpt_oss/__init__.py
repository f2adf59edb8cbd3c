"""engine-gpt-oss: OpenAI's gpt-oss models for engine."""
