"""``engine bench serve``: a load generator against a running OpenAI-compatible server
(``engine serve``, vLLM, ...), as ``vllm bench serve`` and guidellm.

One concept per module: ``http_client`` (HTTP/1.1 over asyncio streams), ``dataset``
(prompts, output lengths and arrival times, pure), ``client`` (one request's body and
the timing of its stream), ``stats`` (per-request records and their percentiles),
``runner`` (server checks, then the timed run), ``report`` (table and JSON). None of
it imports torch.
"""

from engine.bench.serve_load.report import ServeReport
from engine.bench.serve_load.runner import ServeLoadOptions, ServeLoadResult, run_serve_load

__all__ = ["ServeLoadOptions", "ServeLoadResult", "ServeReport", "run_serve_load"]
