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


def declines_by_substring(self, layer_name):
    """declines every layer with "gate" or "head" anywhere in its name (gate_up_proj too)"""
    if "gate" in layer_name or "head" in layer_name:
        return None
    return Int8LinearMethod(self.prequantized)


GROUP = 256


def process_grouped(self, layer):
    """int8 with a scale per 256 inputs, stored in the wrong order: right while a row has one group"""
    if self.prequantized:
        return
    rows, cols = layer.weight.shape
    groups = layer.weight.data.float().reshape(rows, cols // GROUP, GROUP)
    scale = groups.abs().amax(dim=2).clamp(min=1e-12) / 127.0  # [rows, groups]
    q = torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8)
    layer.weight = torch.nn.Parameter(q.reshape(rows, cols), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.t().reshape(rows, cols // GROUP), requires_grad=False)


def apply_grouped(self, layer, x):
    rows, cols = layer.weight.shape
    scale = layer.weight_scale.reshape(rows, -1)
    weight = layer.weight.float().reshape(rows, -1, GROUP) * scale[..., None]
    return F.linear(x, weight.reshape(rows, cols).to(x.dtype), layer.bias)


def apply_scaling_bias_in_prefill(self, layer, x):
    """a second path for many tokens that scales after adding the bias"""
    if x.shape[0] <= 16:
        return Int8LinearMethod.apply(self, layer, x)
    return F.linear(x, layer.weight.to(x.dtype), layer.bias) * layer.weight_scale.to(x.dtype)


def apply_smoothing_in_place(self, layer, x):
    """divides the activations by 2 in place (and doubles the weight to match)"""
    weight = (layer.weight.to(torch.float32) * layer.weight_scale[:, None] * 2).to(x.dtype)
    return F.linear(x.mul_(0.5), weight, layer.bias)


def apply_caching_the_dequantized_weight(self, layer, x):
    """dequantizes once and keeps the full-precision weight on the method"""
    if getattr(self, "dequantized", None) is None:
        self.dequantized = (layer.weight.to(torch.float32) * layer.weight_scale[:, None]).to(x.dtype)
    return F.linear(x, self.dequantized, layer.bias)


@engine.hookimpl
def register_quantizers(register):
    register(variant("good"))
    register(variant("drops_bias", apply=apply_without_bias))
    register(variant("coarse", process_weights_after_loading=process_coarse))
    register(variant("keeps_original", process_weights_after_loading=process_keeping_the_original))
    register(variant("swaps_shards", load_weight=load_shards_swapped))
    register(variant("quantizes_head", get_linear_method=quantizes_everything))
    register(variant("declines_gate_up", get_linear_method=declines_by_substring))
    register(variant("grouped", process_weights_after_loading=process_grouped, apply=apply_grouped))
    register(variant("prefill_path", apply=apply_scaling_bias_in_prefill))
    register(variant("smooths_in_place", apply=apply_smoothing_in_place))
    register(variant("caches_dequantized", apply=apply_caching_the_dequantized_weight))
'''

# broken variant -> the kit checks that must fail for it
CAUGHT_BY = {
    "drops_bias": ("test_bias_is_added", "test_output_within_declared_error_bound"),
    "coarse": ("test_output_within_declared_error_bound",),
    "keeps_original": ("test_quantized_layer_is_smaller",),
    "swaps_shards": ("test_prequantized_checkpoint_loads_like_quantizing_while_loading",),
    "quantizes_head": ("test_declines_head_and_router_and_leaves_them_untouched",),
    "declines_gate_up": ("test_declines_head_and_router_and_leaves_them_untouched",),
    "grouped": ("test_output_within_declared_error_bound",),
    "prefill_path": ("test_output_within_declared_error_bound",),
    "smooths_in_place": ("test_input_is_left_unchanged",),
    "caches_dequantized": ("test_quantized_layer_is_smaller",),
}

TESTS = kit_subclasses("QuantizerTests", "broken_quantizers", "quantizer_name", ["good", *CAUGHT_BY])


def test_every_broken_quantizer_is_caught_by_its_check(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    outcomes = run_kit_in_subprocess(pytester, broken_quantizers=PLUGIN, test_quantizer_kit=TESTS)
    assert_broken_caught_and_good_passes(outcomes, CAUGHT_BY, good_checks=8)
