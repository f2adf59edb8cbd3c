"""Checks for hybrid models, whose linear-attention layers (Mamba-2, DeltaNet, KDA) keep a
recurrent state per request in a state slot, run on a tiny checkpoint
(``engine.testing.checkpoints``) with the plugins that serve it.

Each ``check_*`` function builds the engines it compares (float32, ``kv_cache_memory`` 0.02
GiB unless overridden) and asserts; those that keep the engine under test open return it,
so a caller can assert more. A model plugin's tests call them with their own checkpoint::

    checkpoint = recurrent.checkpoint_fixture("MyHybridForCausalLM")


    def test_prefill_in_chunks_equals_whole_prefill(checkpoint, chunk):
        recurrent.check_chunked_prefill_equals_whole(checkpoint[0], ["cpu", "my_model"], chunk)

The speculation checks want every step to cost the same to the adaptive budget
(:func:`flat_step_costs`), so which drafts are verified never depends on the machine's timings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.testing.generation import greedy_tokens, hf_argmax_tokens, random_prompts

SPECULATION = {"speculative_method": "ngram", "num_speculative_tokens": 3}


def make_llm(path: str | Path, plugins: list[str], **kwargs: Any) -> Any:
    """An ``engine.LLM`` on the checkpoint at ``path`` with ``plugins``: float32, 0.02 GiB of
    cache, no progress bar; ``kwargs`` override or add settings."""
    from engine import LLM

    settings = {"plugins": plugins, "dtype": "float32", "kv_cache_memory": 0.02, "progress": False}
    return LLM(str(path), **{**settings, **kwargs})


def checkpoint_fixture(architecture: str) -> Any:
    """A module-scoped pytest fixture (assign it to a module-level name) giving ``(path,
    hf_model)``: a tiny random checkpoint of ``architecture`` written once for the module, and
    the transformers model on its weights."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
        from engine.testing.checkpoints import make_tiny_checkpoint

        path = tmp_path_factory.mktemp(architecture)
        return path, make_tiny_checkpoint(architecture, path)

    return checkpoint


def state_and_block_bytes(llm: Any, num_states: int, num_blocks: int, block_size: int = 16) -> int:
    """Bytes of float32 cache for ``num_states`` recurrent-state rows and ``num_blocks`` paged
    blocks of the model ``llm`` serves, for a ``kv_cache_memory`` that forces preemption."""
    specs = llm.engine.model.kv_cache_specs()
    row = sum(spec.state_numel() * 4 for spec in specs if spec.is_recurrent)
    return num_states * row + num_blocks * block_size * sum(spec.kv_bytes_per_token(4) for spec in specs)


def all_state_slots_free(llm: Any) -> bool:
    manager = llm.engine.kv_manager
    return sorted(manager.free_state_slots) == list(range(manager.num_state_slots))


# ---------------------------------------------------------------------------------------------
# greedy generation, chunked prefill, preemption, prefix hits
# ---------------------------------------------------------------------------------------------


def check_greedy_tokens_match_transformers(path: str | Path, plugins: list[str], hf_model: Any, n: int = 24) -> None:
    """``n`` greedy tokens of a batch of four prompts (3 to 37 tokens) are transformers' argmax
    over its forward of each growing sequence."""
    batch = random_prompts(0)
    for prompt, tokens in zip(batch, greedy_tokens(make_llm(path, plugins), batch, n)):
        assert tokens == hf_argmax_tokens(hf_model, prompt, n)


def check_chunked_prefill_equals_whole(path: str | Path, plugins: list[str], chunk: int, hf_model: Any = None) -> Any:
    """Prompts (one of 150 tokens, past a 64-token chunk of the chunked forms) prefilled in steps
    of ``chunk`` tokens carry each request's state and convolution inputs from step to step:
    the logits are those of one whole-prompt step (to 1e-4 of the largest), and, given
    ``hf_model``, those of transformers on the same weights."""
    import torch

    batch = random_prompts(1, lengths=(9, 150, 33))
    whole = make_llm(path, plugins).prompt_logits(batch)
    llm = make_llm(path, plugins, max_num_batched_tokens=chunk, max_num_seqs=3)
    chunked = llm.prompt_logits(batch)
    for prompt, a, b in zip(batch, whole, chunked):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, a.abs().max().item())
        if hf_model is not None:
            with torch.no_grad():
                reference = hf_model(torch.tensor([prompt])).logits[0].float()
            assert (a - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item())
    return llm


def check_preemption_keeps_outputs(path: str | Path, plugins: list[str], snapshots: int) -> Any:
    """Five requests of up to 80 tokens in 12 blocks of 16 tokens take turns: requests preempted
    by recompute give their state slot back and start afresh (with ``snapshots`` state
    snapshots: from their longest cached prefix); the greedy outputs are those of one request
    at a time, and after the run every state slot is free again."""
    batch = random_prompts(2, lengths=(9, 33, 50, 21, 40))
    expected = greedy_tokens(make_llm(path, plugins, max_num_seqs=1), batch, 30)
    memory = state_and_block_bytes(make_llm(path, plugins), 5 + snapshots, 12)
    llm = make_llm(
        path,
        plugins,
        kv_cache_memory=memory / 2**30,
        max_model_len=128,
        max_num_seqs=5,
        num_state_snapshots=snapshots,
        state_snapshot_interval=16,
    )
    manager = llm.engine.kv_manager
    assert manager.num_blocks == 12
    assert greedy_tokens(llm, batch, 30) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert all_state_slots_free(llm)
    assert (manager.snapshot_stats.restored > 0) == bool(snapshots)
    return llm


def check_prefix_hits_on_two_tensor_parallel_ranks(path: str | Path, plugins: list[str]) -> None:
    """Both ranks copy their share of the state into and out of the snapshot rows: prompts
    sharing a 40-token prefix, sent one after another to two ranks, give the greedy tokens of
    one rank without prefix caching, every prompt after the first from a snapshot."""
    prefix = random_prompts(6, lengths=(40,))[0]
    batch = [prefix + suffix for suffix in random_prompts(7, lengths=(5, 12, 9))]
    expected = greedy_tokens(make_llm(path, plugins, enable_prefix_caching=False), batch, 12)
    with make_llm(path, plugins, tensor_parallel_size=2, state_snapshot_interval=16) as llm:
        outputs = [greedy_tokens(llm, [p], 12)[0] for p in batch]
        restored = llm.engine.kv_manager.snapshot_stats.restored
    assert restored == len(batch) - 1
    assert outputs == expected


# ---------------------------------------------------------------------------------------------
# speculative decoding: drafts partly rejected have run the state past tokens the request
# does not keep, so the runner puts it back and the kept tokens are recomputed
# ---------------------------------------------------------------------------------------------


def flat_step_costs(monkeypatch: Any) -> None:
    """Makes every step cost the same to the adaptive budget (through pytest's ``monkeypatch``),
    so drafts are always verified: which drafts a step takes then depends on the outputs alone."""
    from engine.spec_decode.budget import StepCostTable

    monkeypatch.setattr(StepCostTable, "estimate", lambda self, num_tokens: 1.0)


def repetitive_prompts() -> list[list[int]]:
    """Prompts made of repeated phrases, so the n-gram proposer finds drafts."""
    phrases = [[17, 45, 9, 101, 33], [200, 7, 7, 64], [5, 90, 12, 250, 31, 8]]
    return [(phrase * 6)[: 12 + 5 * i] for i, phrase in enumerate(phrases)] + [[3, 4, 5, 6] * 3]


def check_ngram_speculation_keeps_outputs(path: str | Path, plugins: list[str], max_num_seqs: int) -> Any:
    """40 greedy tokens of :func:`repetitive_prompts` with n-gram drafts are those without; some
    drafts were kept and some rejected, the runner rewound states, and every slot is free again."""
    expected = greedy_tokens(make_llm(path, plugins, max_num_seqs=max_num_seqs), repetitive_prompts(), 40)
    llm = make_llm(path, plugins, max_num_seqs=max_num_seqs, **SPECULATION)
    assert greedy_tokens(llm, repetitive_prompts(), 40) == expected
    stats = llm.engine.spec.stats
    assert stats.accepted > 0 and stats.accepted < stats.proposed  # drafts kept and drafts rejected
    assert llm.engine.shard.runner.rewinds > 0
    assert all_state_slots_free(llm)
    return llm


def check_speculation_through_preemption(path: str | Path, plugins: list[str]) -> Any:
    """Four states and nine blocks of 16 tokens: requests take turns, preempted ones start afresh
    with drafts, and the outputs are those of one request at a time without speculation."""
    expected = greedy_tokens(make_llm(path, plugins, max_num_seqs=1), repetitive_prompts(), 40)
    memory = state_and_block_bytes(make_llm(path, plugins), 4, 9)
    llm = make_llm(path, plugins, kv_cache_memory=memory / 2**30, max_model_len=80, max_num_seqs=4, **SPECULATION)
    assert greedy_tokens(llm, repetitive_prompts(), 40) == expected
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.shard.runner.rewinds > 0
    return llm


def check_speculation_from_state_snapshots(path: str | Path, plugins: list[str]) -> Any:
    """Chat-like turns, each prompt the previous turn's prompt and output plus a new phrase, sent
    one after another: every turn after the first starts from a state snapshot and drafts from
    there; the outputs are those without speculation or prefix caching."""

    def turns(**kwargs: Any) -> tuple[list[list[int]], Any]:
        llm = make_llm(path, plugins, **kwargs)
        prompt, outputs = repetitive_prompts()[0], []
        for phrase in ([1, 2, 3], [4, 5], [6, 7, 8, 9]):
            tokens = greedy_tokens(llm, [prompt], 40)[0]
            outputs.append(tokens)
            prompt = prompt + tokens + phrase
        return outputs, llm

    expected, _ = turns(enable_prefix_caching=False)
    got, llm = turns(block_size=4, state_snapshot_interval=8, **SPECULATION)
    assert got == expected
    assert llm.engine.kv_manager.snapshot_stats.restored == 2
    assert llm.engine.spec.stats.accepted > 0
    return llm
