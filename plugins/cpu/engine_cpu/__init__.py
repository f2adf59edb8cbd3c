"""engine-cpu: the CPU platform and a paged attention backend in plain torch."""
