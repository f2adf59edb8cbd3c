"""``draft``: a small model with the target's tokenizer drafts greedily, k tokens a step.

The draft model is loaded through the model registry like the target and keeps its
own paged KV cache. Each request has a shadow request on the draft side; before
drafting, its tokens are set to the target's and its cache is kept up to the longest
prefix both agree on (rejected drafts and preemptions roll it back), then the draft
model runs k greedy steps for all requests at once.

Settings (``--speculative-config``): ``model`` (required: a checkpoint directory or
built-in model name), ``kv_cache_memory`` (GiB for the draft's cache, default 0.25).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from engine.interfaces.spec_proposer import DraftRequest, Drafts, ProposerInit, SpecProposer

SETTINGS = ("model", "kv_cache_memory")


class DraftModelProposer(SpecProposer):
    name = "draft"

    def __init__(self, init: ProposerInit) -> None:
        super().__init__(init)
        from engine.model_config import HFConfig
        from engine.model_loader.checkpoint import resolve_model_path
        from engine.runtime.kv_cache_manager import KVCacheManager
        from engine.runtime.model_builder import build_kv_cache, build_model
        from engine.runtime.model_runner import ModelRunner
        from engine.sampling_params import SamplingParams

        config: dict[str, Any] = init.config
        unknown = sorted(set(config) - set(SETTINGS))
        if unknown:
            raise ValueError(f"draft takes {', '.join(SETTINGS)}; unknown: {', '.join(unknown)}.")
        if not isinstance(config.get("model"), str):
            raise ValueError('draft needs the draft model: --speculative-config \'{"model": "PATH"}\'.')
        memory = config.get("kv_cache_memory", 0.25)
        if not isinstance(memory, (int, float)) or memory <= 0:
            raise ValueError(f"draft's kv_cache_memory must be a positive number of GiB, got {memory!r}.")
        path = resolve_model_path(config["model"])
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if int(raw.get("vocab_size", 0)) != init.vocab_size:
            raise ValueError(
                f"The draft model {path} has a vocabulary of {raw.get('vocab_size')} tokens, the target "
                f"{init.vocab_size}: a draft model must share the target's tokenizer."
            )
        architecture = (raw.get("architectures") or ["?"])[0]
        dtype_name = str(init.dtype).removeprefix("torch.")
        self.model = build_model(
            init.components.models.get(architecture),
            HFConfig(raw),
            path,
            init.platform,
            dtype_name,
            init.device,
            progress=False,
        )
        self.max_model_len = int(raw.get("max_position_embeddings", 2048))
        kv_cache = build_kv_cache(
            self.model,
            init.components,
            init.platform,
            dtype_name,
            init.device,
            init.block_size,
            int(memory * 2**30),
            max_model_len=self.max_model_len,
            max_num_seqs=256,
        )
        self.kv_manager = KVCacheManager(kv_cache.num_blocks, init.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, kv_cache, init.device)
        self.greedy = SamplingParams(temperature=0.0)
        self.shadows: dict[str, Any] = {}  # request id -> draft-side Request

    def _sync(self, request: DraftRequest) -> Any:
        """The shadow request holding the target's tokens, its cache valid up to the
        longest prefix both agree on (one token at least left to compute)."""
        from engine.runtime.request import Request

        shadow = self.shadows.get(request.request_id)
        tokens = list(request.token_ids)
        if shadow is None:
            shadow = self.shadows[request.request_id] = Request(request.request_id, tokens, self.greedy)
            return shadow
        common = 0
        limit = min(len(shadow.token_ids), len(tokens), shadow.num_computed_tokens)
        while common < limit and shadow.token_ids[common] == tokens[common]:
            common += 1
        shadow.token_ids = tokens
        shadow.num_computed_tokens = min(common, len(tokens) - 1)
        return shadow

    def propose(self, requests: Sequence[DraftRequest], num_tokens: int, hidden_states=None) -> Drafts:
        from engine.runtime.batch import ScheduledBatch

        shadows = [self._sync(r) for r in requests]
        active = [s for s, r in zip(shadows, requests) if len(r.token_ids) + num_tokens <= self.max_model_len]
        for _ in range(num_tokens):
            batch = ScheduledBatch()
            for shadow in active:
                count = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv_manager.allocate(shadow, count):
                    batch.requests.append(shadow)
                    batch.num_tokens.append(count)
            if not batch.requests:
                break
            batch.sample_indices = list(range(len(batch.requests)))  # each computes up to its newest token
            output = self.runner.execute(batch)
            for shadow, n in zip(batch.requests, batch.num_tokens):
                shadow.num_computed_tokens += n
            for shadow, tokens in zip(output.requests, output.tokens):
                shadow.append_token(tokens[0])
            active = batch.requests  # a request out of draft blocks stops drafting this step
        return Drafts([list(s.token_ids[len(r.token_ids) :]) for s, r in zip(shadows, requests)])

    def remove(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            shadow = self.shadows.pop(request_id, None)
            if shadow is not None:
                self.kv_manager.free(shadow)
