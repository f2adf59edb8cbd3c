"""Gemma 3's published checkpoints of 4B and larger (``Gemma3ForConditionalGeneration``), text only.

They hold a SigLIP vision tower and a projector beside the text model. The text model is
``Gemma3ForCausalLM``'s: its config is ``text_config`` (with transformers'
``Gemma3TextConfig`` defaults for the fields it leaves out) and its tensors are named

- ``language_model.model.*`` and ``language_model.lm_head.weight``: the hub's checkpoints,
  and what transformers' ``save_pretrained`` writes;
- ``model.language_model.*`` and ``lm_head.weight``: transformers 5's module names
  (``save_pretrained(save_original_format=False)``).

The vision tower's and projector's tensors (``vision_tower.*``, ``multi_modal_projector.*``,
either naming) are counted, logged and left out: the model serves text prompts; images are not
supported. An image token in a prompt is embedded as the plain token it is.

Two top-level fields of the multimodal config matter: ``tie_word_embeddings`` (transformers 5
ties the LM head to the embedding by it, not by ``text_config``'s), and
``final_logit_softcapping``, which transformers' ``Gemma3ForConditionalGeneration`` never
applies, wherever it is set: a config that sets it is refused rather than guessed at.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable

import torch

from engine.interfaces.model import ModelInit
from engine.model_config import HFConfig
from engine_gemma.gemma3 import Gemma3ForCausalLM

logger = logging.getLogger("engine.gemma")

# the vision tower and the projector from its outputs to the text model's embeddings
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
# a multimodal checkpoint's prefix -> Gemma3ForCausalLM's
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}


def text_config(config: HFConfig) -> HFConfig:
    """The text model's config: ``text_config`` with the top level's ``tie_word_embeddings``
    (``text_config``'s when the top level has none, as older transformers read it)."""
    top = config.to_dict()
    text = top.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(
            "Gemma3ForConditionalGeneration's config.json has no text_config (the text model's fields); "
            "a Gemma 3 text checkpoint names the architecture Gemma3ForCausalLM instead."
        )
    text = dict(text)
    for where, fields in (("text_config", text), ("the top level", top)):
        cap = fields.get("final_logit_softcapping")
        if cap is not None:
            raise ValueError(
                f"config.json sets final_logit_softcapping {cap} in {where}, which transformers' "
                f"Gemma3ForConditionalGeneration does not apply (its Gemma3ForCausalLM does): set it to null "
                f"to serve the logits uncapped, as transformers does (published Gemma 3 checkpoints set null)."
            )
    if top.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = top["tie_word_embeddings"]
    return HFConfig(text)


def text_model_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The text model's tensors named as ``Gemma3ForCausalLM`` names them; the vision tower's
    and projector's are counted, logged once and left out."""
    skipped = 0
    for name, tensor in weights:
        if name.startswith(VISION_PREFIXES):
            skipped += 1
            continue
        for prefix, text_prefix in TEXT_PREFIXES.items():
            if name.startswith(prefix):
                name = text_prefix + name[len(prefix) :]
                break
        yield name, tensor
    if skipped:
        logger.info(
            "Gemma3ForConditionalGeneration: skipped %d vision-tower and projector tensors; "
            "the model serves text prompts only",
            skipped,
        )


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's published (multimodal) checkpoints, text only."""

    def __init__(self, init: ModelInit) -> None:
        super().__init__(dataclasses.replace(init, config=text_config(init.config)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(text_model_tensors(weights))
