"""The plugin contract: hook specifications of the ``engine`` pluggy project.

Every hook here is a *registration* hook. The core passes a ``register``
callback and owns validation, duplicate detection and lazy resolution; a plugin
only says what it provides. All implementations of a hook are called (no
``firstresult``); their return values are ignored.

The callback signature is the same for every kind::

    register(component)                       # a class with a ``name`` attribute
    register(name, component, override=False) # a class or a "module.path:Class" string

A ``"module.path:Class"`` string is imported only when the component is first
used, so registering costs nothing at start-up. ``override=True`` lets a plugin
replace a component of the same name registered by another distribution; without
it a duplicate name is an error naming both distributions.

Hook modules must not import torch or other heavy modules at import time:
``engine plugins`` loads every plugin and promises not to import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from engine.plugins.registry import RegisterCallback

hookspec = pluggy.HookspecMarker("engine")


# -------------------------------------------------------------------------
# platforms
# -------------------------------------------------------------------------


@hookspec
def register_platforms(register: RegisterCallback) -> None:
    """Register hardware platforms.

    :param register: call ``register(PlatformClass)`` (the class's ``name``
        attribute is the key) or ``register("name", "module:Class")`` for each
        :class:`engine.interfaces.Platform` subclass the plugin provides.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# models
# -------------------------------------------------------------------------


@hookspec
def register_models(register: RegisterCallback) -> None:
    """Register model classes by Hugging Face architecture name.

    :param register: call ``register("LlamaForCausalLM", "pkg.model:LlamaForCausalLM")``
        for each architecture; the key is matched against ``architectures[0]``
        of a checkpoint's ``config.json``. The class implements
        :class:`engine.interfaces.Model`.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# attention backends
# -------------------------------------------------------------------------


@hookspec
def register_attention_backends(register: RegisterCallback) -> None:
    """Register attention backends.

    :param register: call ``register(BackendClass)`` or
        ``register("name", "module:Class")`` for each
        :class:`engine.interfaces.AttentionBackend` subclass. Platforms name
        backends in their preference lists by this key.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# quantizers
# -------------------------------------------------------------------------


@hookspec
def register_quantizers(register: RegisterCallback) -> None:
    """Register quantization methods.

    :param register: call ``register("method", QuantizerClass or "module:Class")``;
        the key matches ``quantization_config.quant_method`` of a checkpoint or
        ``--quantization``. The class implements :class:`engine.interfaces.Quantizer`.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# speculative decoding
# -------------------------------------------------------------------------


@hookspec
def register_spec_proposers(register: RegisterCallback) -> None:
    """Register speculative-decoding draft proposers.

    :param register: call ``register("method", ProposerClass or "module:Class")``;
        the key is what ``--speculative-method`` accepts. The class implements
        :class:`engine.interfaces.SpecProposer`.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# KV-cache tiers
# -------------------------------------------------------------------------


@hookspec
def register_kv_tiers(register: RegisterCallback) -> None:
    """Register secondary KV-cache tiers.

    :param register: call ``register("name", TierClass or "module:Class")``; the
        key is what ``--kv-tier`` accepts. The class implements
        :class:`engine.interfaces.KVTier`.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# structured output
# -------------------------------------------------------------------------


@hookspec
def register_structured_output_backends(register: RegisterCallback) -> None:
    """Register structured-output backends (constraint compilers and matchers).

    :param register: call ``register("name", BackendClass or "module:Class")``; the
        key is what ``--structured-output-backend`` accepts. The class implements
        :class:`engine.interfaces.structured_output.StructuredOutputBackend`.

    Every implementation is called; return values are ignored.
    """


# -------------------------------------------------------------------------
# tool calls and reasoning
# -------------------------------------------------------------------------


@hookspec
def register_tool_parsers(register: RegisterCallback) -> None:
    """Register tool-call parsers (a model family's tool-call format).

    :param register: call ``register("name", ParserClass or "module:Class")``; the key is
        what ``--tool-call-parser`` accepts and what a model class names in its
        ``tool_parser`` attribute. The class implements
        :class:`engine.interfaces.tool_parser.ToolParser`.

    Every implementation is called; return values are ignored.
    """


@hookspec
def register_reasoning_parsers(register: RegisterCallback) -> None:
    """Register reasoning parsers (a thinking model's reasoning markers).

    :param register: call ``register("name", ParserClass or "module:Class")``; the key is
        what ``--reasoning-parser`` accepts and what a model class names in its
        ``reasoning_parser`` attribute. The class subclasses
        :class:`engine.interfaces.reasoning_parser.ReasoningParser`.

    Every implementation is called; return values are ignored.
    """
