"""engine-kv-tier-disk: a persistent KV tier that keeps prefix blocks as files on disk."""
