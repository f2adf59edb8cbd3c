"""Plugin discovery, loading and the component registries."""
