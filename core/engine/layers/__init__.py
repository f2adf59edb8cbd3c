"""Building blocks shared by model plugins (norms, rotary embeddings, linear
layers, the attention layer that dispatches to the selected backend)."""
