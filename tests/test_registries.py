"""Component registries: the registration hooks, names, qualnames, laziness, duplicates, selection."""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from engine import hookspecs
from engine.interfaces.attention import MHA, SLIDING_WINDOW, AttentionBackend, AttentionCapabilities, AttentionSpec
from engine.interfaces.kv_tier import KVTier
from engine.interfaces.platform import Availability, MemoryInfo, Platform
from engine.plugins.components import KINDS, Components
from engine.plugins.manager import PluginLoadWarning, get_plugin_manager
from engine.plugins.registry import ComponentError, Registry
from engine.selection import SelectionError, select_attention_backend, select_platform

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import PluginFactory, hooks_source  # noqa: E402

KV_TIER = "engine.interfaces.kv_tier:KVTier"
BUILT_INS = {
    "kv_tiers": ["cpu"],
    "spec_proposers": ["draft", "mtp", "ngram"],  # what the engine registers itself, with no plugin
    "attention_backends": ["triton_kda", "triton_mamba2", "triton_mla", "triton_paged"],
}


TIER_MODULE = """
from engine.interfaces.kv_tier import KVTier

class Tier(KVTier):
    name = "disk"
    def lookup(self, keys): return 0
    def store(self, keys, blocks): raise NotImplementedError
    def load(self, keys, into): raise NotImplementedError
    def stats(self): return {}
    def close(self): pass

class Holder:
    class Inner(Tier):
        name = "inner"

class NotATier:
    name = "not_a_tier"
"""


# -------------------------------------------------------------------------
# the registration hooks
# -------------------------------------------------------------------------

COMPONENTS_MODULE = """
from engine.interfaces.attention import MHA, AttentionBackend, AttentionCapabilities
from engine.interfaces.kv_tier import KVTier
from engine.interfaces.model import Model
from engine.interfaces.platform import Availability, MemoryInfo, Platform
from engine.interfaces.quantizer import Quantizer
from engine.interfaces.spec_proposer import Drafts, SpecProposer
from engine.interfaces.reasoning_parser import ReasoningParser
from engine.interfaces.structured_output import StructuredOutputBackend
from engine.interfaces.tool_parser import ParsedToolCalls, ToolParser


class ThrowawayPlatform(Platform):
    name = "throwaway_platform"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_dtypes = ("float32",)

    @classmethod
    def is_available(cls):
        return Availability(True, "always")

    def memory_info(self):
        return MemoryInfo(2**20, 2**20)


class ThrowawayModel(Model):
    name = "ThrowawayForCausalLM"

    def kv_cache_specs(self):
        return []

    def forward(self, input_ids, positions, ctx):
        return input_ids

    def compute_logits(self, hidden_states):
        return hidden_states

    def load_weights(self, weights):
        return set()


class ThrowawayBackend(AttentionBackend):
    name = "throwaway_attention"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA}), platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
    )

    def kv_cache_shape(self, num_blocks):
        return (num_blocks,)

    def build_metadata(self, common):
        return common

    def forward(self, q, k, v, kv_cache, metadata):
        return q


class ThrowawayQuantizer(Quantizer):
    name = "throwaway_quant"

    @classmethod
    def from_config(cls, quantization_config):
        return cls()

    def get_linear_method(self, layer_name):
        return None


class ThrowawayProposer(SpecProposer):
    name = "throwaway_spec"

    def propose(self, requests, num_tokens, hidden_states=None):
        return Drafts([[] for _ in requests])


class ThrowawayTier(KVTier):
    name = "throwaway_tier"

    def lookup(self, keys):
        return 0

    def store(self, keys, blocks):
        raise NotImplementedError

    def load(self, keys, into):
        raise NotImplementedError

    def stats(self):
        return {}

    def close(self):
        pass


class ThrowawayStructuredOutput(StructuredOutputBackend):
    name = "throwaway_structured"

    def compile(self, constraint):
        return constraint

    def matcher(self, compiled, max_rollback):
        raise NotImplementedError


class ThrowawayToolParser(ToolParser):
    name = "throwaway_tools"

    def parse(self, text):
        return ParsedToolCalls(text)

    def parse_partial(self, text):
        return ParsedToolCalls(text)


class ThrowawayReasoningParser(ReasoningParser):
    name = "throwaway_reasoning"
"""

CLASS_FOR_KIND = {
    "platforms": "ThrowawayPlatform",
    "models": "ThrowawayModel",
    "attention_backends": "ThrowawayBackend",
    "quantizers": "ThrowawayQuantizer",
    "spec_proposers": "ThrowawayProposer",
    "kv_tiers": "ThrowawayTier",
    "structured_output_backends": "ThrowawayStructuredOutput",
    "tool_parsers": "ThrowawayToolParser",
    "reasoning_parsers": "ThrowawayReasoningParser",
}


def test_every_hookspec_has_a_registry():
    specs = {name for name in dir(hookspecs) if name.startswith("register_")}
    assert {kind.hook for kind in KINDS} == specs
    assert set(CLASS_FOR_KIND) == {kind.attr for kind in KINDS}


# every hook by name, so that a new hook without a test here is noticed (tests/test_plugins_md.py)
HOOKS = [
    "register_platforms",
    "register_models",
    "register_attention_backends",
    "register_quantizers",
    "register_spec_proposers",
    "register_kv_tiers",
    "register_structured_output_backends",
    "register_tool_parsers",
    "register_reasoning_parsers",
]


def test_the_hook_list_above_is_complete():
    assert sorted(HOOKS) == sorted(kind.hook for kind in KINDS)


@pytest.mark.parametrize("hook", HOOKS)
def test_each_hook_registers_a_component_that_resolves_by_name(factory, hook):
    kind = next(k for k in KINDS if k.hook == hook)
    comps = factory.module(factory.name("comps"), COMPONENTS_MODULE)
    cls_name = CLASS_FOR_KIND[kind.attr]
    body = f"""
        register("lazy_{kind.attr}", "{comps}:{cls_name}")
        from {comps} import {cls_name}
        register({cls_name})
    """
    plugin = factory.plugin("six", hooks_source(**{kind.hook: body}), dist="six-dist", version="0.2")

    pm = get_plugin_manager(plugins=plugin)
    registry = pm.components().registry(kind.attr)

    cls = sys.modules[comps].__dict__[cls_name]
    assert not inspect.isabstract(cls)
    assert registry.names() == sorted([cls.name, f"lazy_{kind.attr}", *BUILT_INS.get(kind.attr, [])])
    assert registry.get(cls.name) is cls
    assert registry.get(f"lazy_{kind.attr}") is cls
    module, _, interface = kind.interface.partition(":")
    assert issubclass(cls, getattr(sys.modules[module], interface))
    entry = registry.entry(cls.name)
    assert (entry.plugin, entry.distribution) == (plugin, "six-dist 0.2")
    assert pm.info_for(plugin).hooks == [kind.hook]
    for other in KINDS:
        if other is not kind:
            assert pm.components().registry(other.attr).names() == BUILT_INS.get(other.attr, []), other.attr


def test_single_argument_register_needs_a_class_with_a_name(factory):
    plugin = factory.plugin(
        "nameless",
        hooks_source(
            register_kv_tiers="""
        class Nameless:
            pass
        register(Nameless)
    """
        ),
    )
    pm = get_plugin_manager(plugins=plugin)

    with pytest.raises(ComponentError) as excinfo:
        pm.components()
    message = str(excinfo.value)
    assert f"Plugin {plugin!r} called register(" in message and "Nameless" in message
    assert "a single argument must be a class with a string 'name' attribute" in message
    assert "register('name', component)" in message


def test_single_argument_register_rejects_a_string(factory):
    plugin = factory.plugin("stringonly", hooks_source(register_kv_tiers='register("mod:Tier")'))
    with pytest.raises(ComponentError, match="a single argument must be a class"):
        get_plugin_manager(plugins=plugin).components()


# -------------------------------------------------------------------------
# duplicates
# -------------------------------------------------------------------------


def dup_plugin(factory: PluginFactory, base: str, dist: str, override: bool) -> str:
    body = f'register("dup", "{base}_target:Tier", override={override})'
    return factory.plugin(base, hooks_source(register_kv_tiers=body), dist=dist, version="1.0")


def test_duplicate_name_from_two_distributions_names_both(factory):
    first = dup_plugin(factory, "first", "first-dist", override=False)
    second = dup_plugin(factory, "second", "second-dist", override=False)
    pm = get_plugin_manager(plugins=[first, second])

    with pytest.raises(ComponentError) as excinfo:
        pm.components()
    message = str(excinfo.value)
    assert message.startswith("Duplicate KV tier 'dup'")
    assert f"plugin {first!r} (distribution first-dist 1.0)" in message
    assert f"plugin {second!r} (distribution second-dist 1.0)" in message
    assert "override=True" in message


def test_override_in_the_later_plugin_wins(factory):
    first = dup_plugin(factory, "first", "first-dist", override=False)
    second = dup_plugin(factory, "second", "second-dist", override=True)

    components = get_plugin_manager(plugins=[first, second]).components()

    entry = components.kv_tiers.entry("dup")
    assert (entry.plugin, entry.distribution, entry.target) == (second, "second-dist 1.0", "second_target:Tier")


def test_override_in_the_earlier_plugin_does_not_help(factory):
    first = dup_plugin(factory, "first", "first-dist", override=True)
    second = dup_plugin(factory, "second", "second-dist", override=False)

    with pytest.raises(ComponentError, match="Duplicate KV tier 'dup'"):
        get_plugin_manager(plugins=[first, second]).components()


def test_duplicate_name_among_autoloaded_plugins_skips_both_and_names_them(factory):
    first = dup_plugin(factory, "first", "first-dist", override=False)
    second = dup_plugin(factory, "second", "second-dist", override=False)
    pm = get_plugin_manager()

    with pytest.warns(PluginLoadWarning) as record:
        components = pm.components()

    reason = (
        f"The KV tier 'dup' is registered by two plugins, {first!r} (first-dist 1.0) and {second!r} "
        "(second-dist 1.0), so neither is used. Uninstall one of them, or name the one to use with --plugins."
    )
    assert [str(w.message) for w in record if issubclass(w.category, PluginLoadWarning)] == [reason, reason]
    with pytest.raises(ComponentError) as excinfo:
        components.kv_tiers.get("dup")
    assert str(excinfo.value) == reason
    assert pm.info_for(first).problems == [reason] and pm.info_for(second).problems == [reason]
    assert pm.info_for(first).components == {"kv_tiers": []}
    assert "cpu" in components.platforms and "LlamaForCausalLM" in components.models  # the rest is untouched


def test_a_third_autoloaded_plugin_does_not_take_a_withdrawn_name(factory):
    names = [dup_plugin(factory, base, f"{base}-dist", override=False) for base in ("first", "second", "third")]
    pm = get_plugin_manager()
    with pytest.warns(PluginLoadWarning):
        components = pm.components()
    assert "dup" not in components.kv_tiers
    assert "neither is used" in pm.info_for(names[2]).problems[0]


def test_a_plugin_asked_for_wins_a_duplicate_over_an_autoloaded_one(factory):
    first = dup_plugin(factory, "first", "first-dist", override=False)
    second = dup_plugin(factory, "second", "second-dist", override=False)
    pm = get_plugin_manager(plugins=[second], autoload=True)

    with pytest.warns(PluginLoadWarning, match="which was asked for, registers it too"):
        components = pm.components()

    assert components.kv_tiers.entry("dup").plugin == second
    assert pm.info_for(second).components == {"kv_tiers": ["dup"]} and not pm.info_for(second).problems
    assert pm.info_for(first).components == {"kv_tiers": []} and pm.info_for(first).problems


def test_an_autoloaded_plugin_whose_hook_raises_is_skipped_with_what_it_registered(factory):
    body = 'register("half", "x.y:H")\nraise RuntimeError("no licence file.")'
    broken = factory.plugin("broken", hooks_source(register_kv_tiers=body, register_models='register("M", "x.y:M")'))
    pm = get_plugin_manager()

    with pytest.warns(PluginLoadWarning) as record:
        components = pm.components()

    (message,) = [str(w.message) for w in record if issubclass(w.category, PluginLoadWarning)]
    assert message == (
        f"Plugin {broken!r} (dist-broken-{factory.suffix} 1.0) failed in register_kv_tiers: RuntimeError: "
        "no licence file; nothing it registered there is used."
    )
    assert "half" not in components.kv_tiers  # rolled back
    assert components.models.entry("M").plugin == broken  # its other hooks still count
    assert pm.info_for(broken).problems == [message]


# -------------------------------------------------------------------------
# names and module:Class references
# -------------------------------------------------------------------------


def test_unknown_name_lists_available_names_and_the_qualname_hint():
    registry = Registry("KV tier", KV_TIER)
    registry.add("disk", "a.b:Disk", plugin="p", distribution="d")
    registry.add("cpu", "a.b:Cpu", plugin="p", distribution="d")

    with pytest.raises(ComponentError) as excinfo:
        registry.get("dsk")
    assert str(excinfo.value) == (
        "Unknown KV tier 'dsk'. Available: cpu, disk. Install a plugin that provides it or pass module.path:ClassName."
    )
    assert isinstance(excinfo.value, LookupError)


def test_unknown_name_in_the_real_registries(factory):
    tiers = factory.plugin(
        "tiers", hooks_source(register_kv_tiers='register("disk", "x.y:D")\nregister("cpu", "x.y:C", override=True)')
    )
    components = get_plugin_manager(plugins=["cpu", tiers]).components()

    with pytest.raises(
        ComponentError, match=r"^Unknown KV tier 'dsk'\. Available: cpu, disk\. .*module\.path:ClassName"
    ):
        components.kv_tiers.get("dsk")
    with pytest.raises(ComponentError, match=r"^Unknown platform 'cuda'\. Available: cpu\. "):
        components.platforms.get("cuda")


@pytest.mark.parametrize("kind", KINDS, ids=[kind.attr for kind in KINDS])
def test_unknown_name_with_no_plugin_lists_only_the_built_ins(kind):
    registry = get_plugin_manager(plugins="").components().registry(kind.attr)
    with pytest.raises(ComponentError) as excinfo:
        registry.get("dsk")
    available = ", ".join(BUILT_INS.get(kind.attr, [])) or "none"
    assert str(excinfo.value) == (
        f"Unknown {kind.label} 'dsk'. Available: {available}. "
        "Install a plugin that provides it or pass module.path:ClassName."
    )


def test_a_plugin_may_replace_a_built_in_component_with_override(factory, caplog):
    tiers = factory.plugin("tiers", hooks_source(register_kv_tiers='register("cpu", "x.y:C", override=True)'))
    pm = get_plugin_manager(plugins=[tiers])
    with caplog.at_level(logging.INFO, logger="engine.plugins"):
        entry = pm.components().kv_tiers.entry("cpu")
    assert (entry.plugin, entry.target) == (tiers, "x.y:C")
    assert pm.info_for(tiers).replaced == {
        "kv_tiers": [{"name": "cpu", "plugin": "engine", "target": "engine.kv_tiers.cpu:CpuKVTier"}]
    }
    assert (
        f"Plugin {tiers!r} (dist-tiers-{factory.suffix} 1.0) replaces the engine's built-in KV tier 'cpu'"
        in caplog.text
    )


def test_replacing_a_built_in_without_override_is_an_error_when_asked_for(factory):
    tiers = factory.plugin("tiers", hooks_source(register_kv_tiers='register("cpu", "x.y:C")'))
    with pytest.raises(ComponentError) as excinfo:
        get_plugin_manager(plugins=[tiers]).components()
    assert str(excinfo.value) == (
        f"Plugin {tiers!r} (distribution dist-tiers-{factory.suffix} 1.0) registers the KV tier 'cpu', which is "
        "built into the engine (engine.kv_tiers.cpu:CpuKVTier). Register it with override=True to replace the "
        "built-in one, or choose another name."
    )


def test_replacing_a_built_in_without_override_is_skipped_when_autoloaded(factory):
    tiers = factory.plugin(
        "tiers", hooks_source(register_kv_tiers='register("cpu", "x.y:C")\nregister("mine", "x.y:M")')
    )
    pm = get_plugin_manager()
    with pytest.warns(PluginLoadWarning, match="built into the engine"):
        components = pm.components()
    assert components.kv_tiers.entry("cpu").plugin == "engine"  # the built-in stays
    assert components.kv_tiers.entry("mine").plugin == tiers  # the rest of the plugin is used
    info = pm.info_for(tiers)
    assert info.state == "loaded with problems" and "override=True" in info.problems[0]
    assert info.components == {"kv_tiers": ["mine"]}


@pytest.mark.parametrize("name, target", [("", "a.b:C"), (None, "a.b:C"), ("x", "not a qualname"), ("x", 42)])
def test_add_rejects_bad_names_and_targets(name, target):
    with pytest.raises(ComponentError):
        Registry("KV tier", KV_TIER).add(name, target, plugin="p", distribution="d")


def test_qualname_resolves_without_registration(factory):
    module = factory.module(factory.name("tiermod"), TIER_MODULE)
    registry = Registry("KV tier", KV_TIER)

    cls = registry.get(f"{module}:Tier")

    assert cls is sys.modules[module].Tier and issubclass(cls, KVTier)
    assert registry.get(f"{module}:Holder.Inner") is sys.modules[module].Holder.Inner
    assert registry.names() == []  # resolving does not register


def test_qualname_that_is_not_a_subclass_is_a_type_error_naming_the_interface(factory):
    module = factory.module(factory.name("tiermod"), TIER_MODULE)
    with pytest.raises(TypeError) as excinfo:
        Registry("KV tier", KV_TIER).get(f"{module}:NotATier")
    message = str(excinfo.value)
    assert f"{module}:NotATier" in message
    assert "not a subclass of engine.interfaces.kv_tier.KVTier" in message


def test_registered_component_of_the_wrong_type_names_its_plugin(factory):
    module = factory.module(factory.name("tiermod"), TIER_MODULE)
    registry = Registry("platform", "engine.interfaces.platform:Platform")
    registry.add("tier", f"{module}:Tier", plugin="wrongplug", distribution="wrong-dist 1.0")

    with pytest.raises(TypeError) as excinfo:
        registry.get("tier")
    message = str(excinfo.value)
    assert "plugin 'wrongplug', distribution wrong-dist 1.0" in message
    assert "not a subclass of engine.interfaces.platform.Platform" in message


def test_qualname_with_a_missing_module_is_an_import_error(factory):
    missing = factory.name("nosuchmodule")
    with pytest.raises(ImportError) as excinfo:
        Registry("KV tier", KV_TIER).get(f"{missing}:Tier")
    assert f"Cannot import module {missing!r} for the KV tier '{missing}:Tier'" in str(excinfo.value)


def test_qualname_with_a_missing_attribute_is_an_import_error(factory):
    module = factory.module(factory.name("tiermod"), TIER_MODULE)
    with pytest.raises(ImportError) as excinfo:
        Registry("KV tier", KV_TIER).get(f"{module}:Nope")
    assert f"Module {module!r} has no attribute 'Nope'" in str(excinfo.value)


def test_registration_is_lazy_until_get(factory):
    lazy = factory.module(factory.name("lazytier"), TIER_MODULE)
    plugin = factory.plugin("lazy", hooks_source(register_kv_tiers=f'register("disk", "{lazy}:Tier")'))

    components = get_plugin_manager(plugins=plugin).components()

    assert lazy not in sys.modules
    assert components.kv_tiers.entry("disk").target_repr == f"{lazy}:Tier"
    cls = components.kv_tiers.get("disk")
    assert lazy in sys.modules and cls is sys.modules[lazy].Tier
    assert components.kv_tiers.get("disk") is cls


# -------------------------------------------------------------------------
# platform selection
# -------------------------------------------------------------------------


class FakePlatform(Platform):
    device_type = "fake"
    dist_backend = "gloo"
    supported_dtypes = ("float32",)
    available: ClassVar[bool] = True
    reason: ClassVar[str] = "found one"

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(cls.available, cls.reason)

    def memory_info(self) -> MemoryInfo:
        return MemoryInfo(2**30, 2**30)


def fake_platform(name: str, device_type: str = "fake", available: bool = True, reason: str = "") -> type[Platform]:
    attrs = {"name": name, "device_type": device_type, "available": available, "reason": reason or f"{name} probed"}
    return type(f"Fake_{name}", (FakePlatform,), attrs)


def platforms(*classes: type[Platform]) -> Registry:
    registry = Components().platforms
    for cls in classes:
        registry.add(cls.name, cls, plugin="test", distribution="test")
    return registry


def test_explicit_device_is_chosen_by_name():
    gpu_a, gpu_b = fake_platform("gpu_a"), fake_platform("gpu_b")
    assert type(select_platform(platforms(fake_platform("cpu", "cpu"), gpu_a, gpu_b), "gpu_b")) is gpu_b


def test_explicit_device_that_is_unavailable_is_an_error_with_the_reason():
    registry = platforms(fake_platform("cpu", "cpu"), fake_platform("gpu", available=False, reason="no driver found"))
    with pytest.raises(SelectionError, match=r"^Platform 'gpu' is not available: no driver found$"):
        select_platform(registry, "gpu")


def test_explicit_unknown_device_lists_the_platforms():
    with pytest.raises(ComponentError, match=r"Unknown platform 'tpu'\. Available: cpu, gpu\."):
        select_platform(platforms(fake_platform("cpu", "cpu"), fake_platform("gpu")), "tpu")


def test_single_available_accelerator_is_chosen_over_cpu():
    gpu = fake_platform("gpu")
    registry = platforms(fake_platform("cpu", "cpu"), gpu, fake_platform("npu", available=False))
    assert type(select_platform(registry, None)) is gpu


def test_the_choice_is_logged_with_every_reason(caplog):
    gpu = fake_platform("gpu", reason="1 GPU visible")
    registry = platforms(
        fake_platform("cpu", "cpu"), gpu, fake_platform("npu", available=False, reason="no NPU driver")
    )
    with caplog.at_level(logging.INFO, logger="engine"):
        select_platform(registry, None)
        select_platform(registry, "cpu")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "platform gpu chosen: 1 GPU visible; passed over: cpu (available; an accelerator is preferred, --device cpu "
        "to use it), npu (no NPU driver)",
        "platform cpu chosen (--device cpu): cpu probed",
    ]


def test_two_available_accelerators_are_ambiguous():
    registry = platforms(fake_platform("cpu", "cpu"), fake_platform("gpu_a"), fake_platform("gpu_b"))
    with pytest.raises(SelectionError) as excinfo:
        select_platform(registry, None)
    message = str(excinfo.value)
    assert "More than one platform is available (gpu_a, gpu_b)" in message and "--device" in message


def test_falls_back_to_cpu_when_no_accelerator_is_available():
    cpu = fake_platform("cpu", "cpu")
    assert type(select_platform(platforms(cpu, fake_platform("gpu", available=False)), None)) is cpu


def test_no_available_platform_is_an_error():
    registry = platforms(fake_platform("cpu", "cpu", available=False), fake_platform("gpu", available=False))
    with pytest.raises(SelectionError, match=r"No platform is available \(registered: cpu, gpu\)"):
        select_platform(registry, None)


def test_a_plugin_accelerator_wins_over_the_real_cpu_platform(factory):
    module = factory.module(
        factory.name("accel"),
        """
        from engine.interfaces.platform import Availability, MemoryInfo, Platform

        class Accel(Platform):
            name = "accel"
            device_type = "accel"
            dist_backend = "gloo"
            supported_dtypes = ("float32",)
            available = True

            @classmethod
            def is_available(cls):
                return Availability(cls.available, "one accel")

            def memory_info(self):
                return MemoryInfo(1, 1)
    """,
    )
    plugin = factory.plugin("accelplug", hooks_source(register_platforms=f'register("accel", "{module}:Accel")'))
    registry = get_plugin_manager(plugins=["cpu", plugin]).components().platforms

    assert type(select_platform(registry, None)).__name__ == "Accel"
    sys.modules[module].Accel.available = False
    assert type(select_platform(registry, None)).__name__ == "CpuPlatform"


# -------------------------------------------------------------------------
# attention-backend selection
# -------------------------------------------------------------------------

SPEC = AttentionSpec(kind=MHA, num_heads=8, num_kv_heads=2, head_size=64, scale=0.125)


class FakeBackend(AttentionBackend):
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA}), platforms=frozenset({"fake"}), dtypes=frozenset({"float32"})
    )

    def kv_cache_shape(self, num_blocks):
        return (num_blocks,)

    def build_metadata(self, common):
        return common

    def forward(self, q, k, v, kv_cache, metadata):
        return q


def fake_backend(name: str, **capabilities) -> type[AttentionBackend]:
    caps = {"kinds": frozenset({MHA}), "platforms": frozenset({"fake"}), "dtypes": frozenset({"float32"})}
    caps.update(capabilities)
    return type(f"Backend_{name}", (FakeBackend,), {"name": name, "capabilities": AttentionCapabilities(**caps)})


class NeedsWarp64(FakeBackend):
    name = "warp64"

    @classmethod
    def validate(cls, spec, *, platform, dtype, block_size, kv_cache_dtype="auto"):
        return ["needs a warp size of 64"]


def backends(*classes: type[AttentionBackend]) -> Registry:
    registry = Components().attention_backends
    for cls in classes:
        registry.add(cls.name, cls, plugin="test", distribution="test")
    return registry


def platform_preferring(*names: str) -> Platform:
    cls = type("Prefs", (FakePlatform,), {"name": "fake", "attention_backends": {MHA: names}})
    return cls()


def select(registry: Registry, platform: Platform, requested: str | None = None) -> type[AttentionBackend]:
    return select_attention_backend(registry, platform, SPEC, dtype="float32", block_size=16, requested=requested)


def test_platform_preference_order_is_honoured():
    alpha, zeta = fake_backend("alpha"), fake_backend("zeta")
    registry = backends(alpha, zeta)
    assert select(registry, platform_preferring("zeta", "alpha")) is zeta
    assert select(registry, platform_preferring("alpha", "zeta")) is alpha


def test_backend_whose_validate_returns_reasons_is_skipped():
    fp16_only, good = fake_backend("fp16_only", dtypes=frozenset({"float16"})), fake_backend("good")
    registry = backends(NeedsWarp64, fp16_only, good)
    assert select(registry, platform_preferring("warp64", "fp16_only", "good")) is good


def test_explicit_backend_wins_over_preferences():
    alpha, zeta = fake_backend("alpha"), fake_backend("zeta")
    assert select(backends(alpha, zeta), platform_preferring("alpha"), requested="zeta") is zeta


def test_explicit_backend_that_fails_validation_raises_its_reasons():
    small = fake_backend("small_heads", head_sizes=frozenset({128}), dtypes=frozenset({"float16"}))
    with pytest.raises(SelectionError) as excinfo:
        select(backends(small, fake_backend("good")), platform_preferring("good"), requested="small_heads")
    message = str(excinfo.value)
    assert message.startswith("Attention backend 'small_heads' cannot serve this model: ")
    assert "dtype float32 not supported (supports float16)" in message
    assert "head size 64 not supported (supports [128])" in message


def test_nothing_usable_lists_each_rejected_backend_and_why():
    registry = backends(NeedsWarp64, fake_backend("other_platform", platforms=frozenset({"cuda"})))
    with pytest.raises(SelectionError) as excinfo:
        select(registry, platform_preferring("warp64", "missing", "other_platform"))
    message = str(excinfo.value)
    assert "No attention backend for attention kind 'mha' on platform 'fake'" in message
    assert "warp64: needs a warp size of 64" in message
    assert "missing: not registered (is its plugin loaded?)" in message
    assert "other_platform: platform 'fake' not supported (supports cuda)" in message


def test_platform_without_a_backend_for_the_kind():
    sliding = AttentionSpec(
        kind=SLIDING_WINDOW, num_heads=8, num_kv_heads=2, head_size=64, scale=0.125, sliding_window=4
    )
    with pytest.raises(SelectionError, match="the platform lists no backend for it"):
        select_attention_backend(
            backends(fake_backend("good")), platform_preferring("good"), sliding, dtype="float32", block_size=16
        )


def test_real_cpu_platform_selects_its_paged_backend():
    components = get_plugin_manager(plugins="cpu").components()
    platform = select_platform(components.platforms, None)
    backend = select_attention_backend(components.attention_backends, platform, SPEC, dtype="float32", block_size=16)
    assert (platform.name, backend.name) == ("cpu", "cpu_paged")


def test_every_backend_refuses_a_linear_spec_without_its_state_sizes():
    """The base spec checks cover each kind, so a backend need not repeat them (triton_kda
    declares kind linear and inherits them)."""
    pytest.importorskip("triton")
    from engine.interfaces.attention import LINEAR, AttentionSpec
    from engine.kernels.kda import TritonKdaAttention

    spec = AttentionSpec(LINEAR, 2, 2, 8, 0.1)
    reasons = TritonKdaAttention.validate(spec, platform="cuda", dtype="bfloat16", block_size=16)
    assert "value_size must be set (got None)" in reasons and "conv_kernel must be at least 2 (got None)" in reasons
