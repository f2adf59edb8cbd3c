"""``QuantizerTests``: a quantization method's linear layers against the unquantized
layer they replace.

The oracle is ``F.linear`` in float32 over the same weights. A quantized layer may
differ from it by at most the error bound the quantizer declares, for one token and
for many, on narrow and wide layers; it must add its bias, leave its input alone,
decline the output head and MoE router gates (and nothing else), hold fewer bytes
than the weight it replaces (counting what it caches while running) and, when it
exports prequantized checkpoints, load them back to the layer quantizing while
loading builds. A quantizer that holds mixture-of-experts layers quantized
(``get_experts_method``) has its routed experts checked the same way against dense experts.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from engine.testing.kit.base import KitTests, capability_skip

INPUT_SIZE = 256
# a fused q/k/v-like layer (shards of different sizes) and a plain one
LAYER_SHAPES = ((128, 64, 64), (192,))
# (input size, output shards) of the layers the error bound is checked on: a wide one too, where
# a layout mistake of scales grouped along the input (several groups a row) shows
ERROR_LAYERS = tuple((INPUT_SIZE, sizes) for sizes in LAYER_SHAPES) + ((1024, (192,)),)
TOKENS = 7
# a decode step, a small batch and a prefill chunk: kernels are often chosen by the token count
TOKEN_COUNTS = (1, TOKENS, 40)


def make_layer(
    quantizer: Any, output_sizes: tuple[int, ...], bias: bool, dtype: Any, name: str, input_size: int = INPUT_SIZE
) -> Any:
    """A linear layer given the method ``quantizer`` chooses for ``name``."""
    from engine.layers.linear import MergedLinear

    layer = MergedLinear(input_size, list(output_sizes), bias, dtype)
    method = quantizer.get_linear_method(name)
    assert method is not None, f"{type(quantizer).__name__} declined {name!r}, a plain linear layer."
    layer.set_method(method)
    return layer


def shard_weights(
    output_sizes: tuple[int, ...], dtype: Any, seed: int, input_size: int = INPUT_SIZE
) -> list[tuple[Any, Any]]:
    """Per shard (weight [rows, input_size], bias [rows]): weights scaled so outputs are
    of order one, biases of the same order (a layer that drops its bias is off by ~70%)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        (
            (torch.randn(rows, input_size, generator=gen) / input_size**0.5).to(dtype),
            torch.randn(rows, generator=gen).to(dtype),
        )
        for rows in output_sizes
    ]


def load_unquantized(layer: Any, shards: list[tuple[Any, Any]], bias: bool) -> None:
    for index, (weight, shard_bias) in enumerate(shards):
        layer.load_checkpoint_tensor("weight", index, weight)
        if bias:
            layer.load_checkpoint_tensor("bias", index, shard_bias)
    assert not layer.missing_tensors(), f"the layer still expects {layer.missing_tensors()} after loading"
    layer.method.process_weights_after_loading(layer)


def reference(x: Any, shards: list[tuple[Any, Any]], bias: bool) -> Any:
    import torch

    weight = torch.cat([w for w, _ in shards]).float()
    b = torch.cat([b for _, b in shards]).float() if bias else None
    return torch.nn.functional.linear(x.float(), weight, b)


def relative_error(y: Any, ref: Any) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def held_tensors(obj: Any) -> list[Any]:
    """Tensors an object keeps as attributes, directly or in a list, tuple or dict."""
    import torch

    found = []
    for value in vars(obj).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


def layer_bytes(layer: Any) -> int:
    """Bytes of the layer's parameters and buffers and of tensors the layer or its method
    keep as plain attributes (a dequantized weight cached for the next call counts)."""
    tensors = {
        id(t): t for t in [*layer.parameters(), *layer.buffers(), *held_tensors(layer), *held_tensors(layer.method)]
    }
    return sum(t.numel() * t.element_size() for t in tensors.values())


class QuantizerTests(KitTests):
    """Subclass with ``plugin`` and ``quantizer_name``; ``configs`` maps a label to a
    ``quantization_config`` to check (each is used for on-the-fly quantization and,
    when the quantizer exports checkpoints, as the prequantized checkpoint's config)."""

    registry_name = "quantizers"
    quantizer_name: ClassVar[str | None] = None
    configs: ClassVar[dict[str, dict[str, Any]]] = {"default": {}}

    # helpers

    def quantizer_class(self) -> Any:
        return self.resolve(self.required("quantizer_name"))

    def quantizers(self, *, prequantized: bool = False) -> list[tuple[str, Any]]:
        cls = self.quantizer_class()
        return [
            (label, cls.from_config(dict(config), prequantized=prequantized)) for label, config in self.configs.items()
        ]

    def dtypes(self) -> list[Any]:
        import torch

        # float16 matmuls are too slow on a CPU to check here; a declared float16 is still listed by test_declares
        return [getattr(torch, name) for name in sorted(self.quantizer_class().activation_dtypes) if name != "float16"]

    # checks

    def test_discoverable(self) -> None:
        """The plugin registers the quantizer under its declared name (or ``quantizer_name`` is its
        ``module.path:Class``), as an engine Quantizer."""
        from engine.interfaces.quantizer import Quantizer

        cls = self.quantizer_class()
        assert isinstance(cls, type) and issubclass(cls, Quantizer), cls
        self.assert_named(cls, self.quantizer_name)

    def test_declares_platforms_dtypes_and_error_bound(self) -> None:
        """supported_platforms is None or names; activation_dtypes are torch float dtypes;
        every configuration promises a finite, positive error bound."""
        import math

        cls = self.quantizer_class()
        assert cls.supported_platforms is None or all(isinstance(p, str) for p in cls.supported_platforms)
        assert cls.activation_dtypes and cls.activation_dtypes <= {"float32", "bfloat16", "float16"}
        for label, quantizer in self.quantizers():
            assert 0 < quantizer.error_bound < math.inf, f"config {label!r}: error_bound {quantizer.error_bound}"

    def test_output_within_declared_error_bound(self) -> None:
        """Fused and plain layers of 256 inputs and a plain one of 1024, with and without
        bias, in every declared activation dtype, for 1, 7 and 40 tokens: ‖y_q − y‖/‖y‖
        within the quantizer's error_bound, output in x's dtype."""
        import torch

        failures = []
        for label, quantizer in self.quantizers():
            for dtype in self.dtypes():
                for input_size, sizes in ERROR_LAYERS:
                    for bias in (False, True):
                        shards = shard_weights(sizes, dtype, seed=len(sizes) + bias, input_size=input_size)
                        name = "model.layers.0.self_attn.qkv_proj"
                        layer = make_layer(quantizer, sizes, bias, dtype, name, input_size)
                        load_unquantized(layer, shards, bias)
                        gen = torch.Generator().manual_seed(1)
                        for tokens in TOKEN_COUNTS:
                            x = torch.randn(tokens, input_size, generator=gen).to(dtype)
                            expected = reference(x, shards, bias)
                            with torch.no_grad():
                                y = layer(x)
                            assert y.shape == (tokens, sum(sizes)) and y.dtype == dtype, (
                                f"config {label!r}: output {tuple(y.shape)} {y.dtype}, expected "
                                f"{(tokens, sum(sizes))} {dtype}"
                            )
                            error = relative_error(y, expected)
                            if not error <= quantizer.error_bound:
                                failures.append(
                                    f"config {label!r}, {dtype}, {input_size} inputs, shards {sizes}, bias {bias}, "
                                    f"{tokens} tokens: relative error {error:.4f} > declared {quantizer.error_bound}"
                                )
        assert not failures, "\n".join(failures)

    def test_input_is_left_unchanged(self) -> None:
        """A forward leaves x as it was: the caller still reads it (the residual stream)."""
        import torch

        for label, quantizer in self.quantizers():
            for dtype in self.dtypes():
                sizes = LAYER_SHAPES[0]
                layer = make_layer(quantizer, sizes, True, dtype, "model.layers.0.self_attn.qkv_proj")
                load_unquantized(layer, shard_weights(sizes, dtype, seed=9), True)
                for tokens in TOKEN_COUNTS:
                    x = torch.randn(tokens, INPUT_SIZE, generator=torch.Generator().manual_seed(tokens)).to(dtype)
                    before = x.clone()
                    with torch.no_grad():
                        layer(x)
                    assert torch.equal(x, before), (
                        f"config {label!r}, {dtype}, {tokens} tokens: the layer changed its input in place "
                        f"(largest change {(x.float() - before.float()).abs().max().item():.4g}); work on a copy"
                    )

    def test_bias_is_added(self) -> None:
        """The same quantized weights with and without a bias differ by exactly the bias."""
        import torch

        for label, quantizer in self.quantizers():
            for dtype in self.dtypes():
                sizes = LAYER_SHAPES[0]
                shards = shard_weights(sizes, dtype, seed=3)
                with_bias = make_layer(quantizer, sizes, True, dtype, "model.layers.0.mlp.gate_up_proj")
                without = make_layer(quantizer, sizes, False, dtype, "model.layers.0.mlp.gate_up_proj")
                load_unquantized(with_bias, shards, True)
                load_unquantized(without, shards, False)
                x = torch.randn(TOKENS, INPUT_SIZE, generator=torch.Generator().manual_seed(2)).to(dtype)
                with torch.no_grad():
                    added = with_bias(x).float() - without(x).float()
                bias = torch.cat([b for _, b in shards]).float().expand_as(added)
                assert torch.allclose(added, bias, rtol=2e-2, atol=2e-2), (
                    f"config {label!r}, {dtype}: output with bias minus output without is not the bias "
                    f"(largest difference {(added - bias).abs().max().item():.4f})"
                )

    def test_declines_head_and_router_and_leaves_them_untouched(self) -> None:
        """lm_head and MoE router gates (``...mlp.gate``) stay unquantized, while layers
        merely named like them (``gate_up_proj``) are quantized; in a model quantized by
        the engine the declined layers, the embedding and the norms keep their exact weights."""
        import torch
        from torch import nn

        from engine.layers.layernorm import RMSNorm
        from engine.layers.linear import Linear, UnquantizedLinearMethod, VocabEmbedding, quantize_model

        class Tiny(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed_tokens = VocabEmbedding(64, INPUT_SIZE, torch.float32)
                self.norm = RMSNorm(INPUT_SIZE, 1e-6, torch.float32)
                self.layers = nn.ModuleList([nn.Module()])
                self.layers[0].mlp = nn.Module()
                self.layers[0].mlp.gate = Linear(INPUT_SIZE, 8, False, torch.float32)
                self.layers[0].mlp.gate_up_proj = Linear(INPUT_SIZE, 2 * INPUT_SIZE, False, torch.float32)
                self.layers[0].mlp.down_proj = Linear(INPUT_SIZE, INPUT_SIZE, False, torch.float32)
                self.lm_head = Linear(INPUT_SIZE, 64, False, torch.float32)

        for label, quantizer in self.quantizers():
            for name in ("lm_head", "model.layers.0.mlp.gate", "model.layers.3.block_sparse_moe.gate"):
                assert quantizer.get_linear_method(name) is None, f"config {label!r} quantizes {name!r}"
            model = Tiny()
            quantized, declined = quantize_model(model, quantizer)
            want = ["layers.0.mlp.down_proj", "layers.0.mlp.gate_up_proj"]
            assert sorted(quantized) == want and sorted(declined) == ["layers.0.mlp.gate", "lm_head"], (
                f"config {label!r}: quantized {quantized}, declined {declined}; expected {want} quantized and "
                f"only lm_head and the router gate declined (match the last name component, not a substring)"
            )
            gen = torch.Generator().manual_seed(4)
            untouched = {}
            for path in ("lm_head", "layers.0.mlp.gate"):
                weight = torch.randn(model.get_submodule(path).output_sizes[0], INPUT_SIZE, generator=gen)
                model.get_submodule(path).load_checkpoint_tensor("weight", 0, weight)
                untouched[f"{path}.weight"] = weight
            for name, param in [("embed_tokens.weight", model.embed_tokens.weight), ("norm.weight", model.norm.weight)]:
                param.data.copy_(torch.randn(param.shape, generator=gen))
                untouched[name] = param.data.clone()
            load_unquantized(model.layers[0].mlp.down_proj, shard_weights((INPUT_SIZE,), torch.float32, 5), False)
            for path in ("lm_head", "layers.0.mlp.gate"):
                layer = model.get_submodule(path)
                layer.method.process_weights_after_loading(layer)
                assert type(layer.method) is UnquantizedLinearMethod
            state = dict(model.named_parameters())
            for name, value in untouched.items():
                assert torch.equal(state[name], value), f"config {label!r}: {name} changed"

    def test_quantized_layer_is_smaller(self) -> None:
        """After loading and two forwards, a quantized layer holds fewer bytes than its
        unquantized weight: parameters, buffers and tensors the layer or its method keep as
        attributes (neither the full-precision copy nor a dequantized cache is kept)."""
        import torch

        for label, quantizer in self.quantizers():
            for dtype in self.dtypes():
                sizes = LAYER_SHAPES[0]
                layer = make_layer(quantizer, sizes, False, dtype, "model.layers.0.self_attn.qkv_proj")
                load_unquantized(layer, shard_weights(sizes, dtype, seed=6), False)
                with torch.no_grad():
                    for tokens in (1, TOKENS):
                        layer(torch.randn(tokens, INPUT_SIZE, generator=torch.Generator().manual_seed(6)).to(dtype))
                full = sum(sizes) * INPUT_SIZE * torch.empty(0, dtype=dtype).element_size()
                assert layer_bytes(layer) < full, (
                    f"config {label!r}, {dtype}: quantized layer holds {layer_bytes(layer)} bytes, the "
                    f"unquantized weight {full}"
                )

    def test_prequantized_checkpoint_loads_like_quantizing_while_loading(self) -> None:
        """Checkpoint tensors from ``export_weight``, loaded shard by shard by name into a
        prequantized layer, give the output of the layer that quantized the same weights
        while loading; a name the method does not load is a KeyError."""
        import torch

        on_the_fly = self.quantizers()
        try:
            on_the_fly[0][1].export_weight(torch.zeros(64, INPUT_SIZE), None)
        except NotImplementedError:
            capability_skip("export_weight")
        for (label, quantizer), (_, prequantized) in zip(on_the_fly, self.quantizers(prequantized=True)):
            for dtype in self.dtypes():
                for bias in (False, True):
                    sizes = LAYER_SHAPES[0]
                    shards = shard_weights(sizes, dtype, seed=7 + bias)
                    expected = make_layer(quantizer, sizes, bias, dtype, "model.layers.0.self_attn.qkv_proj")
                    load_unquantized(expected, shards, bias)
                    layer = make_layer(prequantized, sizes, bias, dtype, "model.layers.0.self_attn.qkv_proj")
                    for index, (weight, shard_bias) in enumerate(shards):
                        tensors = quantizer.export_weight(weight, shard_bias if bias else None)
                        for name, tensor in tensors.items():
                            layer.load_checkpoint_tensor(name, index, tensor)
                    assert not layer.missing_tensors(), f"config {label!r}: still missing {layer.missing_tensors()}"
                    with pytest.raises(KeyError):  # a name the method does not load
                        layer.load_checkpoint_tensor("weight.not_a_tensor_of_this_method", 0, torch.zeros(1))
                    layer.method.process_weights_after_loading(layer)
                    x = torch.randn(TOKENS, INPUT_SIZE, generator=torch.Generator().manual_seed(8)).to(dtype)
                    with torch.no_grad():
                        got, want = layer(x), expected(x)
                    error = relative_error(got, want.float())
                    assert error <= 1e-2, (
                        f"config {label!r}, {dtype}, bias {bias}: the prequantized layer differs from the layer "
                        f"quantized while loading by {error:.4f} (relative)"
                    )

    def test_quantized_experts_within_the_error_bound(self) -> None:
        """Where ``get_experts_method`` gives a method: routed experts (3 experts of 256 over 256
        inputs, 2 a token) quantized while loading from dense weights give, for 1, 7 and 40
        tokens, ‖y_q − y‖/‖y‖ within 4 × error_bound of the dense experts in float32 (an expert
        is two layers and the product of two outputs); with ``export_weight``, the experts
        loaded from each projection's exported tensors (by suffix) give the same output to 1e-2."""
        import types

        import torch
        import torch.nn.functional as F

        from engine.interfaces.ops import REFERENCE_OPS
        from engine.layers.moe import PROJECTIONS, Experts

        name = "model.layers.0.mlp.experts"
        on_the_fly = self.quantizers()
        if all(quantizer.get_experts_method(name) is None for _, quantizer in on_the_fly):
            capability_skip("get_experts_method")
        experts_n, inter, hidden = 3, INPUT_SIZE, INPUT_SIZE
        ctx = types.SimpleNamespace(ops=REFERENCE_OPS)
        gen = torch.Generator().manual_seed(11)
        dense = {
            (e, proj): torch.randn(*((inter, hidden) if proj != "down_proj" else (hidden, inter)), generator=gen)
            / (hidden if proj != "down_proj" else inter) ** 0.5
            for e in range(experts_n)
            for proj in PROJECTIONS
        }

        def build(quantizer: Any, dtype: Any, tensors_of: Any) -> Any:
            module = Experts(experts_n, inter, hidden, dtype)
            module.set_method(quantizer.get_experts_method(name))
            for (e, proj), weight in dense.items():
                for suffix, tensor in tensors_of(weight.to(dtype)).items():
                    module.load(e, proj, tensor, suffix)
            module.process_weights_after_loading(name)
            return module

        def expected(x: Any, ids: Any, weights: Any) -> Any:
            out = torch.zeros(x.shape, dtype=torch.float64)
            for t in range(x.shape[0]):
                for e, w in zip(ids[t].tolist(), weights[t].tolist()):
                    gate = x[t].double() @ dense[(e, "gate_proj")].double().t()
                    up = x[t].double() @ dense[(e, "up_proj")].double().t()
                    out[t] += w * ((F.silu(gate) * up) @ dense[(e, "down_proj")].double().t())
            return out

        exports = True
        try:
            on_the_fly[0][1].export_weight(torch.zeros(64, INPUT_SIZE), None)
        except NotImplementedError:
            exports = False
        failures = []
        prequantized = self.quantizers(prequantized=True) if exports else [(None, None)] * len(on_the_fly)
        for (label, quantizer), (_, loaded) in zip(on_the_fly, prequantized):
            if quantizer.get_experts_method(name) is None:
                continue
            for dtype in self.dtypes():
                module = build(quantizer, dtype, lambda weight: {"weight": weight})
                assert not hasattr(module, "w13"), f"config {label!r}: the experts keep their dense stack"
                again = None
                if loaded is not None:
                    again = build(loaded, dtype, lambda weight, export=quantizer.export_weight: export(weight, None))
                for tokens in TOKEN_COUNTS:
                    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
                    ids = torch.stack([torch.randperm(experts_n, generator=gen)[:2] for _ in range(tokens)])
                    weights = torch.rand(tokens, 2, generator=gen)
                    with torch.no_grad():
                        y = module(x, ids, weights, ctx)
                    error = relative_error(y, expected(x, ids, weights).float())
                    if not error <= 4 * quantizer.error_bound:
                        failures.append(
                            f"config {label!r}, {dtype}, {tokens} tokens: relative error {error:.4f} > "
                            f"4 x declared {quantizer.error_bound}"
                        )
                    if again is not None:
                        with torch.no_grad():
                            difference = relative_error(again(x, ids, weights, ctx), y.float())
                        if not difference <= 1e-2:
                            failures.append(
                                f"config {label!r}, {dtype}, {tokens} tokens: experts loaded from exported tensors "
                                f"differ from those quantized while loading by {difference:.4f} (relative)"
                            )
        assert not failures, "\n".join(failures)
