"""The attention kit can fail: it runs against deliberately broken backends and must
catch each bug in the checks meant for it, while a correct backend passes it all.

The backends live in a throwaway plugin module (``PLUGIN_SOURCE``): small
pure-torch paged backends for MHA and for MLA, each with its own cache layout
(correct), and copies with one bug each, plus subclasses of the real ``cpu_paged``
and ``cpu_mla`` with a wrong scale and of ``cpu_indexer``, ``cpu_kda`` and ``cpu_mamba2``
with one bug each. Each
variant gets a generated kit class; all run in one pytest subprocess. (In-process
``pytester`` runs drop the modules they imported from ``sys.modules`` afterwards;
the second such run, re-importing engine-cpu, died with a segfault.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from xml.etree import ElementTree

import pytest

PLUGIN_MODULE = "kit_attention_bug_zoo"

PLUGIN_SOURCE = '''
"""Throwaway plugin: a pure-torch paged attention backend and deliberately broken copies."""
import dataclasses

import torch

import engine
from engine.interfaces.attention import (
    INDEXER, MHA, MLA, SLIDING_WINDOW, AttentionBackend, AttentionCapabilities,
)
from engine_cpu.attention import CpuPagedAttention
from engine_cpu.indexer import CpuIndexer
from engine_cpu.kda import CpuKdaAttention
from engine_cpu.mamba2 import CpuMamba2
from engine_cpu.mla import CpuMlaAttention


class ReferencePaged(AttentionBackend):
    """Correct. Cache layout [block, K/V, offset, Hkv, D] (not cpu_paged's); one loop over
    sequences; cached keys come from the cache, this step's from k/v."""

    name = "kit_ref"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MHA, SLIDING_WINDOW}), platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
    )

    def kv_cache_shape(self, num_blocks):
        return (num_blocks, 2, self.block_size, self.spec.num_kv_heads, self.spec.head_size)

    def build_metadata(self, common):
        return common

    def scale(self):
        return self.spec.scale

    def allowed(self, query_pos, key_pos):  # [n, 1], [1, L] -> [n, L]
        mask = key_pos <= query_pos
        if self.spec.sliding_window is not None:
            mask &= query_pos - key_pos < self.spec.sliding_window
        return mask

    def write(self, kv_cache, slots, k, v):
        kv_cache[slots // self.block_size, 0, slots % self.block_size] = k
        kv_cache[slots // self.block_size, 1, slots % self.block_size] = v

    def forward(self, q, k, v, kv_cache, common):
        self.write(kv_cache, common.slot_mapping, k, v)
        bs, group = self.block_size, self.spec.num_heads // self.spec.num_kv_heads
        out = torch.empty_like(q)
        starts = common.query_start_loc.tolist()
        for b, (context, seq_len) in enumerate(zip(common.context_lens.tolist(), common.seq_lens.tolist())):
            rows = slice(starts[b], starts[b + 1])
            pos = torch.arange(context)
            blocks, offsets = common.block_tables[b, pos // bs], pos % bs
            # keys, values: [L, Hkv, D] -> [H, L, D]
            keys = torch.cat([kv_cache[blocks, 0, offsets], k[rows]]).repeat_interleave(group, 1).transpose(0, 1)
            values = torch.cat([kv_cache[blocks, 1, offsets], v[rows]]).repeat_interleave(group, 1).transpose(0, 1)
            scores = q[rows].transpose(0, 1).float() @ keys.float().transpose(1, 2) * self.scale()  # [H, n, L]
            mask = self.allowed(torch.arange(context, seq_len)[:, None], torch.arange(seq_len)[None, :])
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out[rows] = (probs @ values.float()).transpose(0, 1).to(q.dtype)
        return out


class WrongScale(ReferencePaged):
    name = "kit_bug_scale"

    def scale(self):
        return 1.0 / self.spec.head_size


class DefaultScale(ReferencePaged):
    name = "kit_bug_default_scale"

    def scale(self):
        return self.spec.head_size ** -0.5


class CausalSeesNextKey(ReferencePaged):
    name = "kit_bug_causal_next"

    def allowed(self, query_pos, key_pos):
        return super().allowed(query_pos, key_pos) | (key_pos == query_pos + 1)


class CausalDropsDiagonal(ReferencePaged):
    name = "kit_bug_causal_diagonal"

    def allowed(self, query_pos, key_pos):
        return super().allowed(query_pos, key_pos) & (key_pos != query_pos)


class IgnoresWindow(ReferencePaged):
    name = "kit_bug_window"

    def allowed(self, query_pos, key_pos):
        return key_pos <= query_pos


class NoCacheWrite(ReferencePaged):
    name = "kit_bug_no_write"

    def write(self, kv_cache, slots, k, v):
        pass


class CpuWrongScale(CpuPagedAttention):
    """The real CPU backend (native kernels) with spec.scale replaced by 1/head_size."""

    name = "kit_bug_cpu_scale"

    def __init__(self, spec, block_size, dtype, device):
        super().__init__(dataclasses.replace(spec, scale=1.0 / spec.head_size), block_size, dtype, device)


class CpuIgnoresInvariance(CpuPagedAttention):
    """The real CPU backend, declaring its batch-invariant mode but never entering it: long
    prefill chunks keep their own path, decodes theirs."""

    name = "kit_bug_cpu_variant"

    def build_metadata(self, common):
        wanted, self.batch_invariant = self.batch_invariant, False
        try:
            return super().build_metadata(common)
        finally:
            self.batch_invariant = wanted

    def forward(self, q, k, v, kv_cache, metadata):
        wanted, self.batch_invariant = self.batch_invariant, False
        try:
            return super().forward(q, k, v, kv_cache, metadata)
        finally:
            self.batch_invariant = wanted


class ReferenceMla(AttentionBackend):
    """Correct MLA. Cache layout [block, entry dim, offset] (not cpu_mla's); one loop over
    sequences; cached entries come from the cache, this step's from k."""

    name = "kit_mla_ref"
    capabilities = AttentionCapabilities(
        kinds=frozenset({MLA}), platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
    )

    def kv_cache_shape(self, num_blocks):
        return (num_blocks, self.spec.head_size, self.block_size)

    def build_metadata(self, common):
        return common

    def scale(self):
        return self.spec.scale

    def allowed(self, query_pos, key_pos):  # [n, 1], [1, L] -> [n, L]
        return key_pos <= query_pos

    def scores(self, q, entries):  # [H, n, D], [L, D] -> [H, n, L]
        return q @ entries.T

    def values(self, entries):  # [L, D] -> [L, latent_size]
        return entries[:, : self.spec.latent_size]

    def write(self, kv_cache, slots, k):
        kv_cache[slots // self.block_size, :, slots % self.block_size] = k[:, 0]

    def forward(self, q, k, v, kv_cache, common):
        assert v is None
        self.write(kv_cache, common.slot_mapping, k)
        bs, outs = self.block_size, []
        starts = common.query_start_loc.tolist()
        for b, (context, seq_len) in enumerate(zip(common.context_lens.tolist(), common.seq_lens.tolist())):
            rows = slice(starts[b], starts[b + 1])
            pos = torch.arange(context)
            # entries: [L, D]
            entries = torch.cat([kv_cache[common.block_tables[b, pos // bs], :, pos % bs], k[rows, 0]]).float()
            scores = self.scores(q[rows].transpose(0, 1).float(), entries) * self.scale()
            mask = self.allowed(torch.arange(context, seq_len)[:, None], torch.arange(seq_len)[None, :])
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            outs.append((probs @ self.values(entries)).transpose(0, 1).to(q.dtype))  # [n, H, latent_size]
        return torch.cat(outs)


class MlaValueTail(ReferenceMla):
    name = "kit_bug_mla_value_tail"

    def values(self, entries):
        return entries[:, -self.spec.latent_size :]


class MlaFullValue(ReferenceMla):
    name = "kit_bug_mla_full_value"

    def values(self, entries):
        return entries


class MlaScoresWithoutRope(ReferenceMla):
    name = "kit_bug_mla_no_rope_scores"

    def scores(self, q, entries):
        latent = self.spec.latent_size
        return q[..., :latent] @ entries[:, :latent].T


class MlaDefaultScale(ReferenceMla):
    name = "kit_bug_mla_default_scale"

    def scale(self):
        return self.spec.head_size ** -0.5


class MlaCausalSeesNextKey(ReferenceMla):
    name = "kit_bug_mla_causal_next"

    def allowed(self, query_pos, key_pos):
        return key_pos <= query_pos + 1


class MlaNoCacheWrite(ReferenceMla):
    name = "kit_bug_mla_no_write"

    def write(self, kv_cache, slots, k):
        pass


class CpuMlaWrongScale(CpuMlaAttention):
    """The real cpu_mla with spec.scale replaced by 1/head_size."""

    name = "kit_bug_cpu_mla_scale"

    def __init__(self, spec, block_size, dtype, device):
        super().__init__(dataclasses.replace(spec, scale=1.0 / spec.head_size), block_size, dtype, device)


class SparseIgnoresIndices(CpuMlaAttention):
    """cpu_mla whose sparse path attends to every causal position."""

    name = "kit_bug_sparse_all"

    def forward_sparse(self, q, k, kv_cache, metadata, indices, lse=None):
        return super().forward_sparse(q, k, kv_cache, metadata, None, lse)


class SparsePaddingIsPositionZero(CpuMlaAttention):
    """cpu_mla whose sparse path reads -1 padding as position 0."""

    name = "kit_bug_sparse_padding"

    def forward_sparse(self, q, k, kv_cache, metadata, indices, lse=None):
        return super().forward_sparse(q, k, kv_cache, metadata, None if indices is None else indices.clamp(min=0), lse)


class SparseNoLse(CpuMlaAttention):
    """cpu_mla whose sparse path leaves lse unwritten."""

    name = "kit_bug_sparse_no_lse"

    def forward_sparse(self, q, k, kv_cache, metadata, indices, lse=None):
        return super().forward_sparse(q, k, kv_cache, metadata, indices, None)


class ReferenceIndexer(AttentionBackend):
    """A correct indexer. Cache layout [block, key dim, offset] (not cpu_indexer's); one loop over
    sequences."""

    name = "kit_indexer_ref"
    capabilities = AttentionCapabilities(
        kinds=frozenset({INDEXER}), platforms=frozenset({"cpu"}), dtypes=frozenset({"float32"})
    )

    def kv_cache_shape(self, num_blocks):
        return (num_blocks, self.spec.head_size, self.block_size)

    def build_metadata(self, common):
        return common

    def forward(self, q, k, v, kv_cache, common):
        raise NotImplementedError

    def allowed(self, query_pos, key_pos):  # [n, 1], [1, L] -> [n, L]
        return key_pos <= query_pos

    def write(self, kv_cache, slots, k):
        kv_cache[slots // self.block_size, :, slots % self.block_size] = k[:, 0]

    def forward_index(self, q, k, weights, kv_cache, common):
        self.write(kv_cache, common.slot_mapping, k)
        bs, topk = self.block_size, self.spec.index_topk
        out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
        starts = common.query_start_loc.tolist()
        for b, (context, seq_len) in enumerate(zip(common.context_lens.tolist(), common.seq_lens.tolist())):
            rows = slice(starts[b], starts[b + 1])
            pos = torch.arange(seq_len)
            keys = kv_cache[common.block_tables[b, pos // bs], :, pos % bs].float()  # [L, D]
            per_head = (q[rows].float() @ keys.T * self.spec.scale).relu()  # [n, H, L]
            scores = (weights[rows].float().unsqueeze(-1) * per_head).sum(1)  # [n, L]
            mask = self.allowed(torch.arange(context, seq_len)[:, None], pos[None, :])
            best, chosen = scores.masked_fill(~mask, float("-inf")).topk(min(topk, seq_len), dim=-1)
            out[rows, : chosen.shape[1]] = chosen.masked_fill(best == float("-inf"), -1)
        return out


class IndexerSeesNextKey(ReferenceIndexer):
    name = "kit_bug_indexer_next"

    def allowed(self, query_pos, key_pos):
        return key_pos <= query_pos + 1


class IndexerNoCacheWrite(ReferenceIndexer):
    name = "kit_bug_indexer_no_write"

    def write(self, kv_cache, slots, k):
        pass


class IndexerIgnoresWeights(CpuIndexer):
    """cpu_indexer summing the heads' ReLU scores without their weights."""

    name = "kit_bug_indexer_weights"

    def forward_index(self, q, k, weights, kv_cache, metadata):
        return super().forward_index(q, k, torch.ones_like(weights), kv_cache, metadata)


class IndexerAlwaysAll(CpuIndexer):
    """cpu_indexer that writes its keys but always answers "every position"."""

    name = "kit_bug_indexer_none"

    def forward_index(self, q, k, weights, kv_cache, metadata):
        super().forward_index(q, k, weights, kv_cache, metadata)
        return None


class KdaReference(CpuKdaAttention):
    """The real cpu_kda under the zoo's name."""

    name = "kit_kda_ref"


class KdaIgnoresFresh(CpuKdaAttention):
    """cpu_kda continuing whatever a slot held, even for a sequence with no cached tokens."""

    name = "kit_bug_kda_stale_state"

    def build_metadata(self, common):
        metadata = super().build_metadata(common)
        metadata.fresh = torch.zeros_like(metadata.fresh)
        return metadata


class KdaForgetsState(CpuKdaAttention):
    """cpu_kda that never writes the recurrent state back: every step starts afresh."""

    name = "kit_bug_kda_no_state"

    def forward_linear(self, mixed_qkv, conv_weight, g, beta, state, metadata):
        return super().forward_linear(mixed_qkv, conv_weight, g, beta, state.clone(), metadata)


class KdaNoConvolution(CpuKdaAttention):
    """cpu_kda whose short convolution sees only the current token (kernel of one)."""

    name = "kit_bug_kda_no_conv"

    def forward_linear(self, mixed_qkv, conv_weight, g, beta, state, metadata):
        only_last = torch.zeros_like(conv_weight)
        only_last[:, -1] = conv_weight[:, -1]
        return super().forward_linear(mixed_qkv, only_last, g, beta, state, metadata)


class Mamba2Reference(CpuMamba2):
    """The real cpu_mamba2 under the zoo's name."""

    name = "kit_mamba2_ref"


class Mamba2IgnoresD(CpuMamba2):
    """cpu_mamba2 leaving out the skip term D · x (the states are still right)."""

    name = "kit_bug_mamba2_no_d"

    def forward_mamba2(self, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata):
        return super().forward_mamba2(xbc, conv_weight, conv_bias, dt, dt_bias, A, torch.zeros_like(D), state, metadata)


class Mamba2IgnoresDtLimit(CpuMamba2):
    """cpu_mamba2 that never clamps the time steps to spec.dt_limit."""

    name = "kit_bug_mamba2_no_dt_limit"

    def __init__(self, spec, block_size, dtype, device):
        super().__init__(spec, block_size, dtype, device)
        self.spec = dataclasses.replace(spec, dt_limit=(0.0, float("inf")))


class Mamba2IgnoresFresh(CpuMamba2):
    """cpu_mamba2 continuing whatever a slot held, even for a sequence with no cached tokens."""

    name = "kit_bug_mamba2_stale_state"

    def build_metadata(self, common):
        metadata = super().build_metadata(common)
        metadata.fresh = torch.zeros_like(metadata.fresh)
        return metadata


class Mamba2WrongGroup(CpuMamba2):
    """cpu_mamba2 whose heads read B and C from the groups in reverse order (group G - 1 - g)."""

    name = "kit_bug_mamba2_wrong_group"

    def forward_mamba2(self, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata):
        spec = self.spec
        x_channels, width = spec.num_heads * spec.head_size, spec.state_size
        groups = torch.arange(spec.num_groups).flip(0)[:, None] * width + torch.arange(width)  # [G, N]
        perm = torch.cat([torch.arange(x_channels), x_channels + groups.flatten(),
                          x_channels + spec.num_groups * width + groups.flatten()])
        bias = None if conv_bias is None else conv_bias[perm]
        return super().forward_mamba2(xbc[:, perm], conv_weight[perm], bias, dt, dt_bias, A, D, state, metadata)


class Mamba2PrivateState(CpuMamba2):
    """cpu_mamba2 continuing from its own copy of the states and copying that into the slots
    after each step: slot rows copied between steps (snapshots, rewinds) are lost."""

    name = "kit_bug_mamba2_private_state"

    def forward_mamba2(self, xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, metadata):
        if not hasattr(self, "own_state"):
            self.own_state = state.clone()
        y = super().forward_mamba2(xbc, conv_weight, conv_bias, dt, dt_bias, A, D, self.own_state, metadata)
        state.copy_(self.own_state)
        return y


@engine.hookimpl
def register_attention_backends(register):
    for cls in (ReferencePaged, WrongScale, DefaultScale, CausalSeesNextKey, CausalDropsDiagonal, IgnoresWindow,
                NoCacheWrite, CpuWrongScale, CpuIgnoresInvariance, ReferenceMla, MlaValueTail, MlaFullValue, MlaScoresWithoutRope,
                MlaDefaultScale, MlaCausalSeesNextKey, MlaNoCacheWrite, CpuMlaWrongScale, SparseIgnoresIndices,
                SparsePaddingIsPositionZero, SparseNoLse, ReferenceIndexer, IndexerSeesNextKey, IndexerNoCacheWrite,
                IndexerIgnoresWeights, IndexerAlwaysAll, KdaReference, KdaIgnoresFresh, KdaForgetsState,
                KdaNoConvolution, Mamba2Reference, Mamba2IgnoresD, Mamba2IgnoresDtLimit, Mamba2IgnoresFresh,
                Mamba2WrongGroup, Mamba2PrivateState):
        register(cls)
'''

# backend -> (the bug, kit checks that must fail, kit checks that must pass); test_kv_cache_write
# checks the cache alone, so a backend that writes its cache right but attends wrongly passes it
WRITE_CHECK = {"test_kv_cache_write"}
ATTENTION_OUTPUTS = {"test_mha", "test_sliding_window"}
ATTENTION_CHECKS = ATTENTION_OUTPUTS | WRITE_CHECK
MLA_CHECKS = {"test_mla"} | WRITE_CHECK
OTHER_CHECKS = {"test_discoverable", "test_validate"}
INDEXER_CHECKS = {"test_indexer"} | WRITE_CHECK
MAMBA2_CHECKS = {"test_mamba2", "test_mamba2_state"}
VARIANTS = {
    "kit_ref": ("none: the correct reference", set(), ATTENTION_CHECKS | OTHER_CHECKS),
    "kit_bug_scale": (
        "softmax scale 1/head_size instead of spec.scale",
        ATTENTION_OUTPUTS,
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_default_scale": (
        "head_size ** -0.5 instead of spec.scale",
        {"test_mha", "test_sliding_window"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_cpu_scale": ("cpu_paged subclass, scale 1/head_size", ATTENTION_OUTPUTS, WRITE_CHECK | OTHER_CHECKS),
    "kit_bug_cpu_variant": (
        "cpu_paged subclass declaring a batch-invariant mode it never enters",
        {"test_batch_invariant_mode"},
        ATTENTION_CHECKS | OTHER_CHECKS,
    ),
    "kit_bug_causal_next": (
        "causal mask lets a query see the next key",
        {"test_mha", "test_sliding_window"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_causal_diagonal": (
        "causal mask drops the diagonal (own key)",
        ATTENTION_OUTPUTS,
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_window": (
        "ignores the sliding window",
        {"test_sliding_window"},
        {"test_mha", "test_kv_cache_write"} | OTHER_CHECKS,
    ),
    "kit_bug_no_write": ("does not write the new K/V into the cache", ATTENTION_CHECKS, OTHER_CHECKS),
    "kit_mla_ref": ("none: the correct MLA reference", set(), MLA_CHECKS | OTHER_CHECKS),
    "kit_bug_mla_value_tail": (
        "MLA values are the entries' last latent_size dims",
        {"test_mla"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_mla_full_value": ("MLA values are the whole entries", {"test_mla"}, WRITE_CHECK | OTHER_CHECKS),
    "kit_bug_mla_no_rope_scores": ("MLA scores leave out the rope dims", {"test_mla"}, WRITE_CHECK | OTHER_CHECKS),
    "kit_bug_mla_default_scale": (
        "MLA: head_size ** -0.5 instead of spec.scale",
        {"test_mla"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_mla_causal_next": (
        "MLA causal mask lets a query see the next key",
        {"test_mla"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_mla_no_write": ("MLA: does not write the new entries into the cache", MLA_CHECKS, OTHER_CHECKS),
    "kit_bug_cpu_mla_scale": ("cpu_mla subclass, scale 1/head_size", {"test_mla"}, WRITE_CHECK | OTHER_CHECKS),
    "kit_bug_sparse_all": (
        "sparse MLA attends to every causal position, not the selected ones",
        {"test_sparse_mla"},
        MLA_CHECKS | OTHER_CHECKS,
    ),
    "kit_bug_sparse_padding": (
        "sparse MLA reads -1 padding as position 0",
        {"test_sparse_mla"},
        MLA_CHECKS | OTHER_CHECKS,
    ),
    "kit_bug_sparse_no_lse": ("sparse MLA leaves lse unwritten", {"test_sparse_mla"}, MLA_CHECKS | OTHER_CHECKS),
    "kit_indexer_ref": ("none: the correct indexer reference", set(), INDEXER_CHECKS | OTHER_CHECKS),
    "kit_bug_indexer_next": ("the indexer may select the next position", {"test_indexer"}, WRITE_CHECK | OTHER_CHECKS),
    "kit_bug_indexer_no_write": ("the indexer does not write its keys", INDEXER_CHECKS, OTHER_CHECKS),
    "kit_bug_indexer_weights": (
        "cpu_indexer subclass ignoring the head weights",
        {"test_indexer"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_bug_indexer_none": (
        "cpu_indexer subclass answering 'every position' for long sequences",
        {"test_indexer"},
        WRITE_CHECK | OTHER_CHECKS,
    ),
    "kit_kda_ref": ("none: the real cpu_kda", set(), {"test_linear"} | OTHER_CHECKS),
    "kit_bug_kda_stale_state": (
        "KDA continues a slot's stale state for a fresh sequence",
        {"test_linear"},
        OTHER_CHECKS,
    ),
    "kit_bug_kda_no_state": ("KDA never writes its state back", {"test_linear"}, OTHER_CHECKS),
    "kit_bug_kda_no_conv": ("KDA's short convolution sees only the current token", {"test_linear"}, OTHER_CHECKS),
    "kit_mamba2_ref": ("none: the real cpu_mamba2", set(), MAMBA2_CHECKS | OTHER_CHECKS),
    "kit_bug_mamba2_no_d": ("Mamba-2 leaves out D · x", {"test_mamba2"}, {"test_mamba2_state"} | OTHER_CHECKS),
    "kit_bug_mamba2_no_dt_limit": ("Mamba-2 never clamps the time steps to dt_limit", MAMBA2_CHECKS, OTHER_CHECKS),
    "kit_bug_mamba2_stale_state": (
        "Mamba-2 continues a slot's stale state for a fresh sequence",
        MAMBA2_CHECKS,
        OTHER_CHECKS,
    ),
    "kit_bug_mamba2_wrong_group": ("Mamba-2 heads read B and C from the wrong group", MAMBA2_CHECKS, OTHER_CHECKS),
    "kit_bug_mamba2_private_state": (
        "Mamba-2 continues from its own copy of the states, losing copies of slot rows",
        MAMBA2_CHECKS,
        OTHER_CHECKS,
    ),
}


@pytest.fixture(scope="module")
def kit_outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, list[str]]]]:
    """Run the kit against every variant, in one pytest subprocess (the plugin module and the
    engine-cpu kernels are imported there, never into this process):
    {backend: {check: {"passed"/"failed"/"skipped": [param ids], "how": {failure labels}}}}."""
    folder = tmp_path_factory.mktemp("kit_bugs")
    (folder / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    classes = "".join(
        f"\n\nclass Test_{backend}(AttentionBackendTests):\n    plugin = {PLUGIN_MODULE!r}\n"
        f"    backend_name = {backend!r}\n"
        for backend in VARIANTS
    )
    (folder / "test_generated_kit.py").write_text(
        "from engine.testing.kit.attention import AttentionBackendTests" + classes
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGINE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # tiny shapes: threads only add overhead
    xml = folder / "report.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--tb=line",
            f"--junitxml={xml}",
            "--rootdir",
            str(folder),
            "test_generated_kit.py",
        ],
        check=False,
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list, how=set())))
    for case in ElementTree.parse(xml).iter("testcase"):
        backend = case.get("classname").rsplit(".", 1)[-1].removeprefix("Test_")
        name, _, params = case.get("name").partition("[")
        by = outcomes[backend][name]
        failures = [child for child in case if child.tag in ("failure", "error")]
        skipped = any(child.tag == "skipped" for child in case)
        by["failed" if failures else "skipped" if skipped else "passed"].append(params.rstrip("]") or "-")
        for failure in failures:  # "AssertionError: step 2 (...), AttentionSpec(...": keep "step 2 (...)"
            message = (failure.get("message") or "").removeprefix("AssertionError: ")
            by["how"].add(message.split(", ")[0].split(": ")[0][:80])
    return outcomes


@pytest.mark.parametrize("backend", list(VARIANTS))
def test_kit_catches_bug(kit_outcomes, backend: str, record_property) -> None:
    """Each broken variant fails exactly where expected; the correct reference fails nowhere."""
    bug, must_fail, must_pass = VARIANTS[backend]
    outcomes = kit_outcomes[backend]
    assert outcomes, f"no kit results for {backend}"
    failing = {name for name, by in outcomes.items() if by["failed"]}
    caught = {
        name: f"{len(by['failed'])}/{len(by['failed']) + len(by['passed'])} cases: {sorted(by['how'])}"
        for name, by in sorted(outcomes.items())
        if by["failed"]
    }
    print(f"\n{backend} ({bug}): caught by {caught or 'nothing'}")
    record_property("caught_by", caught)
    assert must_fail <= failing, f"{backend} ({bug}) slipped through {sorted(must_fail - failing)}: {caught}"
    wrongly = failing & must_pass
    assert not wrongly, f"{backend}: {sorted(wrongly)} failed: {[dict(outcomes[n]) for n in sorted(wrongly)]}"
    assert all(outcomes[name]["passed"] for name in must_pass), {n: dict(outcomes[n]) for n in must_pass}
