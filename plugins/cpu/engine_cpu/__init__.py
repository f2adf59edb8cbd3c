"""engine-cpu: the CPU platform and paged attention backends (MHA/GQA, MLA) in plain torch."""
