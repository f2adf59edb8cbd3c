"""QuantizerTests fails a broken quantizer: each deliberately broken variant of the
example int8 quantizer below is caught by the kit checks named next to it, and the
real one passes them all."""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import assert_broken_caught_and_good_passes, kit_subclasses, run_kit_in_subprocess  # noqa: E402

pytest_plugins = ["pytester"]

PLUGIN = '''
import torch
import torch.nn.functional as F

import engine
from engine_example_plugins.int8_quantizer import Int8LinearMethod, Int8Quantizer


def variant(name, method=Int8LinearMethod, **overrides):
    class Method(method):
        pass

    class Variant(Int8Quantizer):
        def get_linear_method(self, layer_name):
            chosen = super().get_linear_method(layer_name)
            return None if chosen is None else Method(self.prequantized)

    Variant.name = name
    for attr, value in overrides.items():
        setattr(Method if hasattr(Int8LinearMethod, attr) else Variant, attr, value)
    return Variant


def apply_without_bias(self, layer, x):
    weight = (layer.weight.to(torch.float32) * layer.weight_scale[:, None]).to(x.dtype)
    return F.linear(x, weight)


def coarse_rows(weight):
    """3 levels a row while promising int8's error bound"""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12)
    return torch.round(weight.float() / scale[:, None]).to(torch.int8), scale


def process_coarse(self, layer):
    q, scale = coarse_rows(layer.weight.data)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)


def process_keeping_the_original(self, layer):
    original = layer.weight.data.clone()
    Int8LinearMethod.process_weights_after_loading(self, layer)
    layer.original_weight = torch.nn.Parameter(original, requires_grad=False)


def load_shards_swapped(self, layer, name, shard, tensor):
    """a prequantized shard lands in the rows of the next shard"""
    swapped = (shard + 1) % len(layer.output_sizes) if layer.output_sizes[shard] == layer.output_sizes[
        (shard + 1) % len(layer.output_sizes)] else shard
    Int8LinearMethod.load_weight(self, layer, name, swapped, tensor)


def quantizes_everything(self, layer_name):
    return Int8LinearMethod(self.prequantized)


@engine.hookimpl
def register_quantizers(register):
    register(variant("good"))
    register(variant("drops_bias", apply=apply_without_bias))
    register(variant("coarse", process_weights_after_loading=process_coarse))
    register(variant("keeps_original", process_weights_after_loading=process_keeping_the_original))
    register(variant("swaps_shards", load_weight=load_shards_swapped))
    register(variant("quantizes_head", get_linear_method=quantizes_everything))
'''

# broken variant -> the kit checks that must fail for it
CAUGHT_BY = {
    "drops_bias": ("test_bias_is_added", "test_output_within_declared_error_bound"),
    "coarse": ("test_output_within_declared_error_bound",),
    "keeps_original": ("test_quantized_layer_is_smaller",),
    "swaps_shards": ("test_prequantized_checkpoint_loads_like_quantizing_while_loading",),
    "quantizes_head": ("test_declines_head_and_router_and_leaves_them_untouched",),
}

TESTS = kit_subclasses("QuantizerTests", "broken_quantizers", "quantizer_name", ["good", *CAUGHT_BY])


def test_every_broken_quantizer_is_caught_by_its_check(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    outcomes = run_kit_in_subprocess(pytester, broken_quantizers=PLUGIN, test_quantizer_kit=TESTS)
    assert_broken_caught_and_good_passes(outcomes, CAUGHT_BY, good_checks=7)
