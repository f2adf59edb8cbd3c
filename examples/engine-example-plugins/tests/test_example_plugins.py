"""The example plugin passes engine's conformance kit, loaded through its entry point
and through its module path, and serves a model end to end."""

from __future__ import annotations

import torch

from engine.testing.kit import AttentionBackendTests, KVTierTests, QuantizerTests, SpecProposerTests


class TestViaEntryPoint(AttentionBackendTests):
    plugin = "example"
    backend_name = "example_torch_paged"
    dtypes = ("float32", "bfloat16")


class TestViaModulePath(AttentionBackendTests):
    plugin = "engine_example_plugins.plugin"
    backend_name = "example_torch_paged"
    dtypes = ("float32",)


class TestSqliteTierViaEntryPoint(KVTierTests):
    plugin = "example"
    tier_name = "example_sqlite"

    def config(self, directory, capacity_bytes):
        return {**super().config(directory, capacity_bytes), "path": str(directory / "blocks.sqlite")}


class TestSqliteTierViaModulePath(TestSqliteTierViaEntryPoint):
    plugin = "engine_example_plugins.plugin"


class TestInt8QuantizerViaEntryPoint(QuantizerTests):
    plugin = "example"
    quantizer_name = "example_int8"


class TestInt8QuantizerViaModulePath(TestInt8QuantizerViaEntryPoint):
    plugin = "engine_example_plugins.plugin"


class TestRandomProposerViaEntryPoint(SpecProposerTests):
    plugin = "example"
    proposer_name = "example_random"


class TestRandomProposerViaModulePath(TestRandomProposerViaEntryPoint):
    plugin = "engine_example_plugins.plugin"


def assert_greedy_like(llm, hf_model) -> None:
    """12 greedy tokens of the engine equal transformers' generate on the same prompt."""
    from engine.sampling_params import SamplingParams

    prompt = [5, 17, 42, 7, 99]
    output = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)[
            0, len(prompt) :
        ].tolist()
    assert output.token_ids == expected


def test_serves_a_model_like_transformers(tiny_checkpoint):
    from engine.llm import LLM

    path, hf_model = tiny_checkpoint("LlamaForCausalLM")
    llm = LLM(
        str(path),
        plugins=["cpu", "llama", "example"],
        attention_backend="example_torch_paged",
        dtype="float32",
        kv_cache_memory=0.01,
        progress=False,
    )
    assert_greedy_like(llm, hf_model)


def test_quantized_model_generates_like_the_dequantized_weights(tiny_checkpoint):
    """--quantization example_int8 gives the greedy tokens of transformers running the same
    checkpoint with every quantized weight replaced by its dequantized value."""
    from engine.llm import LLM
    from engine_example_plugins.int8_quantizer import quantize_rows

    path, hf_model = tiny_checkpoint("LlamaForCausalLM")
    llm = LLM(
        str(path),
        plugins=["cpu", "llama", "example"],
        quantization="example_int8",
        dtype="float32",
        kv_cache_memory=0.01,
        progress=False,
    )
    state = hf_model.state_dict()
    for name, tensor in state.items():
        if name.endswith("proj.weight"):  # every linear layer but lm_head
            q, scale = quantize_rows(tensor)
            tensor.copy_(q.float() * scale[:, None])
    hf_model.load_state_dict(state)
    assert_greedy_like(llm, hf_model)
