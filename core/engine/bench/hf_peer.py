"""The HF transformers peer: ``generate`` on the same checkpoint, in the same process.

EOS is ignored by removing it from this peer's own ``generation_config``
(``eos_token_id=None``), so every ``generate`` runs exactly ``max_new_tokens``
steps and no logits processor is added; the output lengths are checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.bench.metrics import RequestTiming
from engine.bench.roofline import weight_bytes
from engine.bench.workloads import BenchRequest

PAD_TOKEN_ID = 0  # only ever under attention_mask 0


@dataclass
class PeerRun:
    timings: list[RequestTiming]  # empty for static batches (no per-request clock)
    wall: float


def _token_clock() -> Any:
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """Stamps every batch of new tokens; ``generate`` first puts the prompt, skipped."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._seen_prompt = False

        def put(self, value: torch.Tensor) -> None:
            value.cpu()  # on a GPU: the step's tokens exist once they can be read
            if self._seen_prompt:
                self.times.append(time.perf_counter())
            self._seen_prompt = True

        def end(self) -> None:
            pass

    return TokenClock()


class HFPeer:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=...)`` (``LlamaForCausalLM`` for
    Llama checkpoints), greedy ``generate`` on ``device`` (the engine's, so that a GPU engine
    is compared with HF on the same GPU)."""

    name = "hf"

    def __init__(self, model_path: str | Path, dtype: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        bar_was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
            self.device = torch.device(device)
            self.model.to(self.device)
        finally:
            if bar_was_enabled:
                hf_logging.enable_progress_bar()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = PAD_TOKEN_ID

    def describe(self) -> dict[str, Any]:
        import transformers

        return {
            "class": type(self.model).__name__,
            "transformers": transformers.__version__,
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "device": str(self.device),
        }

    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    def _generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, **kwargs: Any
    ) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model.generate(
                input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **kwargs,
            )
            out = out.cpu()  # done when the tokens are back (a GPU's work is asynchronous)
        generated = out.shape[1] - input_ids.shape[1]
        if generated != max_new_tokens:
            raise RuntimeError(f"HF generate produced {generated} new tokens, asked for exactly {max_new_tokens}.")
        return out

    def warm_up(self, request: BenchRequest) -> None:
        self.run_sequential([request])

    def run_sequential(self, requests: Sequence[BenchRequest]) -> PeerRun:
        """One ``generate`` per request, each after the previous returned. A streamer stamps
        each new token: TTFT = call -> token 1; decode time = token 1 -> token N."""
        timings = []
        start = time.perf_counter()
        for r in requests:
            input_ids = torch.tensor([r.prompt_token_ids], dtype=torch.int64)
            clock = _token_clock()
            submitted = time.perf_counter()
            self._generate(input_ids, torch.ones_like(input_ids), r.output_len, streamer=clock)
            if len(clock.times) != r.output_len:
                raise RuntimeError(f"The token clock saw {len(clock.times)} steps, expected {r.output_len}.")
            timings.append(RequestTiming(submitted, clock.times[0], clock.times[-1], r.prompt_len, r.output_len))
        return PeerRun(timings, time.perf_counter() - start)

    def run_static_batches(self, requests: Sequence[BenchRequest], batch_size: int) -> PeerRun:
        """Batches of ``batch_size`` requests in order, left-padded (attention_mask 0 on the
        padding); each batch generates max(output_len) of its members."""
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(r.prompt_len for r in batch)
            input_ids = torch.tensor(
                [[PAD_TOKEN_ID] * (width - r.prompt_len) + list(r.prompt_token_ids) for r in batch], dtype=torch.int64
            )
            attention_mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch])
            self._generate(input_ids, attention_mask, max(r.output_len for r in batch))
        return PeerRun([], time.perf_counter() - start)
