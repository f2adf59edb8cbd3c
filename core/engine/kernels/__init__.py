"""Kernels shared by platforms: torch reference forms (``*_torch``) and Triton kernels, the
latter imported only when a backend that runs them is resolved (never by ``import engine``).

``BUILTIN_ATTENTION_BACKENDS`` are registered by the engine itself (plugin ``engine``), for
GPU platforms to list in their preferences.
"""

BUILTIN_ATTENTION_BACKENDS = {
    "triton_paged": "engine.kernels.paged_attention:TritonPagedAttention",
    "triton_mla": "engine.kernels.paged_attention:TritonMlaAttention",
    "triton_kda": "engine.kernels.kda:TritonKdaAttention",
    "triton_mamba2": "engine.kernels.mamba2:TritonMamba2",
}
