"""What the DeepSeek tests share: the engine on a tiny checkpoint, random prompts, greedy output."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams

PLUGINS = ["cpu", "deepseek_v4"]


def make_llm(path, **kwargs) -> LLM:
    """The engine on the checkpoint at ``path``, in fp32, with a small KV cache."""
    return LLM(
        str(path), **{"plugins": PLUGINS, "dtype": "float32", "kv_cache_memory": 0.05, "progress": False, **kwargs}
    )


def prompts(seed: int, lengths=(3, 11, 20, 37)) -> list[list[int]]:
    """Random prompts of ``lengths`` over the tiny vocabulary (ids 3..319)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in lengths]


def greedy(llm: LLM, batch: list[list[int]], n: int) -> list[list[int]]:
    """``n`` greedy tokens for every prompt of ``batch``, decoded as one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
