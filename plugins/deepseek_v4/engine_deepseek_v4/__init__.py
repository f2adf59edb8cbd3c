"""engine-deepseek-v4: the DeepSeek family (V3 and Kimi-K2 so far) for engine."""
