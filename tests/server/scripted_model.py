"""A model plugin for the tests only: ``ScriptedForCausalLM`` answers every conversation with
the reply its checkpoint's script gives, token by token, whatever the batch.

The script is ``config.json``'s ``script``: a list of ``[needle, reply]``; the reply is that
of the last rule whose needle the prompt holds (``""`` matches any prompt). The prompt ends
at the last ``prompt_end`` text of the sequence (the chat template's generation prompt);
the model stores every token id in a token-state cache and reads its whole sequence back,
so each next token is the reply's token after those already written. Past the reply's end
it writes EOS. The logits put all the weight on that token, so a sampled output is the
reply unless an output constraint or the engine (a thinking budget) decides otherwise.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Iterable

import torch

import engine
from engine.interfaces.attention import TOKEN_STATE, AttentionSpec
from engine.interfaces.model import Model, ModelInit

ARCHITECTURE = "ScriptedForCausalLM"


@engine.hookimpl
def register_models(register):
    register(ARCHITECTURE, f"{__name__}:ScriptedForCausalLM")


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class ScriptedForCausalLM(Model):
    def __init__(self, init: ModelInit) -> None:
        super().__init__()
        raw = init.config.to_dict()
        self.script = [tuple(rule) for rule in raw["script"]]
        self.prompt_end = raw["prompt_end"]
        self.tokenizer_path = raw["tokenizer_path"]
        self.vocab_size = int(raw["vocab_size"])
        self.eos = int(raw["eos_token_id"])
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=init.dtype, device=init.device), requires_grad=False)

    def kv_cache_specs(self) -> list[AttentionSpec]:
        return [AttentionSpec(TOKEN_STATE, 1, 1, 1, 1.0)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        ctx.store(0, input_ids.to(self.scale.dtype)[:, None])
        longest = int(positions.max()) + 1
        grid = torch.arange(longest, device=positions.device).expand(len(positions), longest)
        wanted = torch.where(grid <= positions[:, None], grid, torch.full_like(grid, -1))
        history = ctx.gather(0, wanted)[..., 0].round().long()  # [T, longest]
        nexts = [self._next(history[t, : int(positions[t]) + 1].tolist()) for t in range(len(positions))]
        return torch.tensor(nexts, dtype=self.scale.dtype, device=input_ids.device)[:, None]

    def _next(self, sequence: list[int]) -> int:
        tokenizer = _tokenizer(self.tokenizer_path)
        end = tokenizer.encode(self.prompt_end, add_special_tokens=False)
        cut = None
        for i in range(len(sequence) - len(end), -1, -1):
            if sequence[i : i + len(end)] == end:
                cut = i + len(end)
                break
        if cut is None:
            return self.eos
        prompt = tokenizer.decode(sequence[:cut])
        reply = ""
        for needle, text in self.script:
            if needle in prompt:
                reply = text
        tokens = _encode(self.tokenizer_path, reply) + [self.eos]
        written = len(sequence) - cut
        return tokens[written] if written < len(tokens) else self.eos

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(len(hidden_states), self.vocab_size, dtype=torch.float32, device=hidden_states.device)
        logits.scatter_(1, hidden_states[:, :1].round().long(), 100.0)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "scale":
                self.scale.data.copy_(tensor)
                loaded.add(name)
        return loaded


@functools.lru_cache(maxsize=256)
def _encode_cached(path: str, text: str) -> tuple[int, ...]:
    return tuple(_tokenizer(path).encode(text, add_special_tokens=False))


def _encode(path: str, text: str) -> list[int]:
    return list(_encode_cached(path, text))


def make_scripted_checkpoint(
    path: Path,
    script: list[tuple[str, str]],
    *,
    tokenizer_from: Path,
    chat_template: str | None = None,
    added_tokens: tuple[str, ...] = (),
) -> Path:
    """A checkpoint of ``ScriptedForCausalLM`` with the tokenizer of ``tokenizer_from`` (and
    ``chat_template`` in place of its own, ``added_tokens`` added as ordinary tokens, as
    Qwen3 has ``<think>``), answering by ``script``."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    if added_tokens:
        tokenizer.add_tokens(list(added_tokens))
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    generation_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
    )
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    prompt_end = generation_prompt[len(plain) :] if generation_prompt.startswith(plain) else generation_prompt[-12:]
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "scripted",
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "max_position_embeddings": 2048,
        "hidden_size": 1,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "torch_dtype": "float32",
        "script": [list(rule) for rule in script],
        "prompt_end": prompt_end,
        "tokenizer_path": str(path),
    }
    (path / "config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
    save_file({"scale": torch.ones(1)}, str(path / "model.safetensors"))
    return path
