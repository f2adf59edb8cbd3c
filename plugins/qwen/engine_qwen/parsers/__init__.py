"""engine-qwen's tool-call parsers."""
