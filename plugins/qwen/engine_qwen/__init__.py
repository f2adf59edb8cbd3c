"""engine-qwen: Qwen's hybrid models (gated DeltaNet + gated attention) for engine."""
