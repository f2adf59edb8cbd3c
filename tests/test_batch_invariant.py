"""--batch-invariant: in bf16, every request's tokens are bitwise the same alone, all together,
in random batches, and with its prompt cut into chunks or partly served from the prefix cache."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.layers.linear import MergedLinear, RowByRowLinearMethod, UnquantizedLinearMethod, make_batch_invariant
from engine.selection import SelectionError

WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from".split()


def make_prompts(n: int = 32, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(20))  # half the prompts share a prefix
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(n)]
    return [shared + " " + p if i % 2 else p for i, p in enumerate(prompts)]


def token_ids(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def in_random_batches(llm: LLM, prompts: list[str], params: SamplingParams, rng: random.Random) -> list[list[int]]:
    order = list(range(len(prompts)))
    rng.shuffle(order)
    result: list[list[int] | None] = [None] * len(prompts)
    while order:
        size = rng.randint(2, 9)
        batch, order = order[:size], order[size:]
        for i, ids in zip(batch, token_ids(llm, [prompts[i] for i in batch], params)):
            result[i] = ids
    return result  # type: ignore[return-value]


@pytest.fixture(scope="module")
def engines():
    common = dict(dtype="bfloat16", batch_invariant=True, progress=False, kv_cache_memory=0.05)
    whole = LLM("demo", **common)
    # a small step budget: prompts are prefilled in chunks, beside other requests' chunks and decodes
    chunked = LLM("demo", max_num_batched_tokens=24, **common)
    yield whole, chunked
    whole.close()
    chunked.close()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_32_requests_are_bitwise_the_same_alone_together_and_in_random_batches(engines, params):
    whole, chunked = engines
    prompts = make_prompts()
    alone = [token_ids(whole, [p], params)[0] for p in prompts]
    assert all(len(ids) == 16 for ids in alone)
    rng = random.Random(1)
    runs = {
        "together": token_ids(whole, prompts, params),
        "random batches": in_random_batches(whole, prompts, params, rng),
        "chunked, together": token_ids(chunked, prompts, params),
    }
    for name, ids in runs.items():
        same = sum(a == b for a, b in zip(alone, ids))
        assert same == len(prompts), f"{name}: {same}/{len(prompts)} identical to the request alone"


def test_row_by_row_method_gives_each_row_the_bits_it_has_alone():
    class BlockedByRowCount(UnquantizedLinearMethod):
        """A method whose sums follow the row count, as a blocked GEMM's may."""

        def apply(self, layer, x):
            rows = x.reshape(-1, x.shape[-1]).float()
            chunk = 8 if rows.shape[0] > 1 else 64
            parts = [rows[:, i : i + chunk] @ layer.weight[:, i : i + chunk].float().t() for i in range(0, 64, chunk)]
            total = parts[0].bfloat16()
            for part in parts[1:]:  # partial sums rounded as they are added
                total = total + part.bfloat16()
            return total.view(*x.shape[:-1], -1)

    gen = torch.Generator().manual_seed(0)
    layer = MergedLinear(64, [32], False, torch.bfloat16, method=BlockedByRowCount())
    layer.weight.data.copy_(torch.randn(32, 64, generator=gen) * 10)
    x = torch.randn(5, 7, 64, generator=gen).bfloat16()
    alone = torch.stack([torch.cat([layer(x[i, j : j + 1]) for j in range(7)]) for i in range(5)])
    assert not torch.equal(layer(x), alone)  # the method alone depends on the batch
    layer.method = RowByRowLinearMethod(layer.method)
    assert torch.equal(layer(x), alone)


def test_make_batch_invariant_wraps_what_does_not_declare_it():
    class Invariant(UnquantizedLinearMethod):
        batch_invariant = True

    class Quantized(UnquantizedLinearMethod):
        pass

    model = nn.ModuleList(
        [
            MergedLinear(8, [8], False, torch.float32),
            MergedLinear(8, [8], False, torch.float32, method=Quantized()),
            MergedLinear(8, [8], False, torch.float32, method=Invariant()),
        ]
    )
    assert make_batch_invariant(model, RowByRowLinearMethod(UnquantizedLinearMethod())) == 2
    assert [type(layer.method) for layer in model] == [RowByRowLinearMethod, RowByRowLinearMethod, Invariant]
    assert type(model[1].method.inner) is Quantized


def test_an_attention_backend_without_a_batch_invariant_mode_is_refused():
    from engine.interfaces.attention import MHA, AttentionSpec
    from engine.selection import select_attention_backend
    from engine_cpu.attention import CpuPagedAttention
    from engine_cpu.platform import CpuPlatform

    class BatchDependent(CpuPagedAttention):
        name = "batch_dependent"
        capabilities = CpuPagedAttention.capabilities.__class__(
            **{**CpuPagedAttention.capabilities.__dict__, "batch_invariant": False}
        )

    backends = {BatchDependent.name: BatchDependent}
    spec = AttentionSpec(kind=MHA, num_heads=4, num_kv_heads=4, head_size=64, scale=0.125)
    kwargs = dict(dtype="bfloat16", block_size=16, requested="batch_dependent")
    assert select_attention_backend(backends, CpuPlatform(), spec, **kwargs) is BatchDependent
    with pytest.raises(SelectionError, match="no batch-invariant mode"):
        select_attention_backend(backends, CpuPlatform(), spec, batch_invariant=True, **kwargs)


def test_routed_experts_are_refused_with_the_reason():
    from engine.layers.moe import Experts
    from engine.runtime.model_builder import refuse_batch_variant_layers

    class WithExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Experts.__new__(Experts)
            nn.Module.__init__(self.experts)

    with pytest.raises(ValueError, match="routed experts .*no batch-invariant path"):
        refuse_batch_variant_layers(WithExperts())
    refuse_batch_variant_layers(nn.Linear(2, 2))  # nothing to refuse
