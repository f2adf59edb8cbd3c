"""The engine layer: resolving an ``EngineConfig`` into components, the model shard each
rank runs, the step loop (``LLMEngine``) and its output processing."""
