"""Checks of the Mamba-2 mixer's selective scan (kind ``mamba2``,
:class:`engine.interfaces.attention.Mamba2Backend`): each request's state continued in its slot,
against :func:`naive_mamba2`, a token-by-token reading of ``forward_mamba2``'s contract written
here apart from the engine's own forms."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from engine.interfaces.attention import MAMBA2, AttentionBackend, AttentionSpec
from engine.testing.kit.attention.base import AttentionKitBase, make_common_metadata

# Mamba-2: (heads, head_size, state_size, groups, convolution kernel, conv bias, dt_limit)
MAMBA2_SHAPES = {
    "g1": (2, 8, 16, 1, 4, True, (0.0, math.inf)),
    "g2": (4, 6, 8, 2, 3, False, (0.1, 0.6)),
    "g3": (6, 4, 5, 3, 2, True, (0.2, 1.5)),
}
# per step: [(sequence, new tokens)]; sequences start fresh in slots that hold garbage
MAMBA2_BATCHES = {
    # prefill chunks of ragged lengths across the 16- and 64-token chunk edges, in changing
    # row orders, then decodes, then a mixed step
    "steps": (
        [(0, 70), (1, 5), (2, 17)],
        [(1, 60), (0, 9), (2, 16)],
        [(2, 1), (0, 1), (1, 1)],
        [(0, 1), (1, 1), (2, 1)],
        [(1, 1), (2, 20), (0, 3)],
    ),
    # one-token steps where sequences start fresh beside others that continue; sequences 3
    # and 4 take the slots of 1 and 2 once those finished (their states are garbage to them)
    "fresh": (
        [(0, 1)],
        [(0, 1), (1, 1)],
        [(2, 1), (1, 1), (0, 1)],
        [(2, 4), (1, 1)],
        [(3, 1), (0, 1)],
        [(3, 6), (4, 2), (0, 1)],
        [(4, 1), (3, 1)],
    ),
}
# "rewind": sequence 0's slot row is copied to a spare slot after REWIND_AT tokens; after two
# more steps of it, sequence 2 (its first REWIND_AT tokens, then others) continues from the
# copy put back into sequence 0's slot, and sequence 3 (the same prefix, others again) from the
# spare slot itself
REWIND_AT = 20
REWIND_STEPS = (
    [(0, REWIND_AT), (1, 7)],
    [(0, 3), (1, 1)],
    [(0, 1), (1, 1)],
    [(2, 1), (3, 5), (1, 1)],
    [(3, 1), (2, 4)],
    [(2, 1), (3, 1)],
)


def naive_mamba2(
    spec: AttentionSpec,
    xbc: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba-2 scan of one whole sequence from a zero state, token by token.

    xbc: [L, conv_channels]; dt: [L, H]; the rest as ``forward_mamba2`` takes them. The input
    at position t convolves with the ``kernel - 1`` before it (zeros before the sequence), plus
    the bias, SiLU, rounded to xbc's dtype: x [H, head_size], B and C [G, state_size]; head
    ``h`` reads group ``h // (H / G)``; ``Δ = clamp(softplus(dt + dt_bias), *dt_limit)``,
    ``S_h = exp(Δ_h A_h) S_h + Δ_h x_h B_gᵀ`` and ``y_h = S_h C_g + D_h x_h``.

    Returns (y [L, H, head_size], S after each token [L, H, head_size, state_size]), float32.
    """
    heads, head_size, state_size, groups = spec.num_heads, spec.head_size, spec.state_size, spec.num_groups
    length, channels = xbc.shape
    kernel = conv_weight.shape[1]
    low, high = spec.dt_limit
    padded = torch.cat([torch.zeros(kernel - 1, channels), xbc.float()])
    bias = torch.zeros(channels) if conv_bias is None else conv_bias.float()
    state = torch.zeros(heads, head_size, state_size)
    ys = torch.zeros(length, heads, head_size)
    states = torch.zeros(length, heads, head_size, state_size)
    for t in range(length):
        convolved = (padded[t : t + kernel].T * conv_weight.float()).sum(dim=1) + bias  # [C]
        activated = F.silu(convolved).to(xbc.dtype).float()
        x, b, c = activated.split([heads * head_size, groups * state_size, groups * state_size])
        x, b, c = x.view(heads, head_size), b.view(groups, state_size), c.view(groups, state_size)
        delta = F.softplus(dt[t].float() + dt_bias.float()).clamp(low, high)  # [H]
        for h in range(heads):
            g = h // (heads // groups)
            decay = torch.exp(delta[h] * A[h].float())
            state[h] = decay * state[h] + delta[h] * torch.outer(x[h], b[g])
            ys[t, h] = state[h] @ c[g] + D[h].float() * x[h]
        states[t] = state
    return ys, states


@dataclass
class Mamba2Case:
    """One layer's weights and every sequence's inputs by position, with the oracle's results."""

    spec: AttentionSpec
    conv_weight: torch.Tensor  # [C, kernel]
    conv_bias: torch.Tensor | None  # [C]
    dt_bias: torch.Tensor  # [H] float32
    A: torch.Tensor  # [H] float32, negative
    D: torch.Tensor  # [H] float32
    xbc: list[torch.Tensor]  # per sequence [L, C]
    dt: list[torch.Tensor]  # per sequence [L, H]
    y: list[torch.Tensor]  # per sequence [L, H, head_size]: the oracle's outputs
    ssm: list[torch.Tensor]  # per sequence [L, H, head_size, state_size]: the oracle's S after each token


class Mamba2Checks(AttentionKitBase):
    """``test_mamba2`` and ``test_mamba2_state``."""

    @pytest.mark.parametrize("shape", list(MAMBA2_SHAPES))
    @pytest.mark.parametrize("batch", [*MAMBA2_BATCHES, "rewind"])
    def test_mamba2(self, batch: str, shape: str, dtype: str, engine_device: str) -> None:
        """The Mamba-2 scan (``forward_mamba2``) continuing each request's state in its slot
        (slots shuffled, garbage in them at first): prefill chunks of ragged lengths across
        chunk edges, decodes and a mixed step ("steps"); one-token steps where sequences start
        fresh beside others that continue, and new sequences in the slots of finished ones
        ("fresh"); or a slot row copied aside, put back later and copied on, as snapshots and
        rewinds do ("rewind"). One and several groups of B and C, with and without the
        convolution's bias, default and narrow ``dt_limit``. Every step's output (float32
        [T, H, head_size]) matches the token-by-token oracle over the whole sequence, the
        inputs are left alone and slots outside the step keep their bytes."""
        self.run_mamba2_case(batch, shape, dtype, engine_device, check_state=False)

    @pytest.mark.parametrize("shape", list(MAMBA2_SHAPES))
    @pytest.mark.parametrize("batch", ["steps", "rewind"])
    def test_mamba2_state(self, batch: str, shape: str, dtype: str, engine_device: str) -> None:
        """After every step of ``test_mamba2``'s "steps" and "rewind" (outputs unchecked here),
        each slot of the step holds its sequence's state as the oracle has it after the sequence's last token: the
        last ``conv_kernel - 1`` convolution inputs (zeros before the sequence), then S
        [H, head_size, state_size], flat, in the documented layout ``[num_slots,
        spec.state_numel()]`` (another layout keeps its contents private: only the rewinds of
        ``test_mamba2`` check them)."""
        self.run_mamba2_case(batch, shape, dtype, engine_device, check_state=True)

    def new_mamba2_case(
        self,
        spec: AttentionSpec,
        with_bias: bool,
        torch_dtype: torch.dtype,
        lengths: list[int],
        gen: torch.Generator,
        branches: bool,
    ) -> Mamba2Case:
        """Random weights and inputs (on the CPU), and the oracle's results of every sequence;
        with ``branches``, sequences 2 and 3 begin with sequence 0's first REWIND_AT tokens."""
        channels, heads = spec.conv_channels, spec.num_heads
        conv_weight = (0.5 * torch.randn(channels, spec.conv_kernel, generator=gen)).to(torch_dtype)
        conv_bias = (0.3 * torch.randn(channels, generator=gen)).to(torch_dtype) if with_bias else None
        dt_bias = 0.5 * torch.randn(heads, generator=gen)
        A = -(3 * torch.rand(heads, generator=gen) + 0.05)
        D = torch.randn(heads, generator=gen)
        xbc = [torch.randn(n, channels, generator=gen).to(torch_dtype) for n in lengths]
        dt = [torch.randn(n, heads, generator=gen).to(torch_dtype) for n in lengths]
        case = Mamba2Case(spec, conv_weight, conv_bias, dt_bias, A, D, xbc, dt, [], [])
        if branches:
            for b in (2, 3):
                xbc[b][:REWIND_AT], dt[b][:REWIND_AT] = xbc[0][:REWIND_AT], dt[0][:REWIND_AT]
        for x, d in zip(xbc, dt):
            y, ssm = naive_mamba2(spec, x, conv_weight, conv_bias, d, dt_bias, A, D)
            case.y.append(y)
            case.ssm.append(ssm)
        return case

    def expected_state(self, case: Mamba2Case, seq: int, end: int) -> torch.Tensor:
        """Sequence ``seq``'s flat state after ``end`` tokens: its last ``kernel - 1`` inputs
        (zeros before the sequence), then S."""
        spec = case.spec
        width = spec.conv_kernel - 1
        padded = torch.cat([torch.zeros(width, spec.conv_channels), case.xbc[seq].float()])
        return torch.cat([padded[end : end + width].flatten(), case.ssm[seq][end - 1].flatten()])

    def run_mamba2_case(self, batch: str, shape: str, dtype: str, engine_device: str, check_state: bool) -> None:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{MAMBA2}/{batch}/{shape}/{dtype}".encode()))
        cls, device = self.setup_backend(MAMBA2, dtype, engine_device, 16)
        heads, head_size, state_size, groups, kernel, with_bias, dt_limit = MAMBA2_SHAPES[shape]
        declared = cls.capabilities.head_sizes
        if declared is not None and head_size not in declared:
            head_size = min(declared)
        spec = AttentionSpec(
            MAMBA2,
            heads,
            heads,
            head_size,
            1.0,
            conv_kernel=kernel,
            state_size=state_size,
            num_groups=groups,
            dt_limit=dt_limit,
        )
        torch_dtype = getattr(torch, dtype)
        backend = cls(spec, 16, torch_dtype, device)
        steps = REWIND_STEPS if batch == "rewind" else MAMBA2_BATCHES[batch]
        lengths = [0] * (1 + max(b for step in steps for b, _ in step))
        for step in steps:
            for b, n in step:
                lengths[b] += n
        if batch == "rewind":  # 2 and 3 go on after sequence 0's first REWIND_AT tokens
            lengths[2] += REWIND_AT
            lengths[3] += REWIND_AT
        case = self.new_mamba2_case(spec, with_bias, torch_dtype, lengths, gen, branches=batch == "rewind")
        num_slots = len(lengths) + 3
        order = torch.randperm(num_slots, generator=gen).tolist()
        spare = order[-1]
        slots = order[: len(lengths)]
        if batch == "fresh":  # 3 and 4 take the slots of 1 and 2 (finished by then)
            slots[3], slots[4] = slots[1], slots[2]
        elif batch == "rewind":  # 2 in 0's slot (after the rewind), 3 in the spare one
            slots[2], slots[3] = slots[0], spare
        state = torch.randn(backend.kv_cache_shape(num_slots), generator=gen)  # garbage
        state = state.to(backend.cache_dtype(torch_dtype)).to(device)
        assert state.shape[0] == num_slots, (
            f"kv_cache_shape({num_slots}) is {tuple(state.shape)}: a mamba2 state holds one row per "
            f"slot, so its first dimension should be {num_slots}"
        )
        conventional = tuple(state.shape) == (num_slots, spec.state_numel())
        if check_state and not conventional:
            pytest.skip(
                f"the state's layout {tuple(state.shape)} is not [num_slots, spec.state_numel()]: "
                "its contents are private (test_mamba2 checks them through rewinds)"
            )
        weights = [
            None if t is None else t.to(device)
            for t in (case.conv_weight, case.conv_bias, case.dt_bias, case.A, case.D)
        ]
        (atol, rtol) = self.tolerances[dtype]
        atol, rtol = max(atol, 1e-4), max(rtol, 1e-4)  # a chunked form sums in another order
        done = [0] * len(lengths)
        for index, step in enumerate(steps):
            if batch == "rewind" and index == 1:  # a snapshot of sequence 0 after REWIND_AT tokens
                state[spare] = state[slots[0]]
            if batch == "rewind" and index == 3:  # rewind: 0's slot back to the snapshot, 2 and 3 go on
                state[slots[0]] = state[spare]
                done[2] = done[3] = REWIND_AT
            label = f"step {index + 1} of {batch} ({spec}, conv bias {with_bias})"
            self.run_mamba2_step(case, backend, state, slots, done, step, label, weights, atol, rtol, not check_state)
            for b, n in step:
                done[b] += n
            if check_state:
                for b, _ in step:
                    torch.testing.assert_close(
                        state[slots[b]].float().cpu(),
                        self.expected_state(case, b, done[b]),
                        atol=atol,
                        rtol=rtol,
                        msg=lambda m, label=label, b=b: (
                            f"{label}: slot {slots[b]} of sequence {b} after its {done[b]} tokens does not hold "
                            f"its last {spec.conv_kernel - 1} convolution inputs, then S\n{m}"
                        ),
                    )

    def run_mamba2_step(
        self,
        case: Mamba2Case,
        backend: AttentionBackend,
        state: torch.Tensor,
        slots: list[int],
        done: list[int],
        step: list[tuple[int, int]],
        label: str,
        weights: list[torch.Tensor | None],
        atol: float,
        rtol: float,
        check_output: bool,
    ) -> None:
        """One engine step: batch row ``i`` is sequence ``step[i][0]`` with ``done`` cached
        tokens and ``step[i][1]`` new ones. Checks that the inputs are left alone, that no
        slot outside the step changed and (with ``check_output``) the output against the
        oracle."""
        spec, device = case.spec, state.device
        seqs, news = [b for b, _ in step], [n for _, n in step]
        starts = [done[b] for b in seqs]
        tables = [[0] * -(-(s + n) // 16) for s, n in zip(starts, news)]  # no per-token cache: any blocks
        common = make_common_metadata(starts, news, tables, 16, device, [slots[b] for b in seqs])

        def rows(per_seq: list[torch.Tensor]) -> torch.Tensor:  # the step's rows, in batch order
            return torch.cat([per_seq[b][s : s + n] for b, s, n in zip(seqs, starts, news)])

        xbc, dt = rows(case.xbc).to(device), rows(case.dt).to(device)
        inputs = [t for t in (xbc, dt, *weights) if t is not None]
        copies = [t.clone() for t in inputs]
        others = [slot for slot in range(state.shape[0]) if slot not in {slots[b] for b in seqs}]
        before = state[others].clone()
        conv_weight, conv_bias, dt_bias, A, D = weights
        with torch.inference_mode():
            out = backend.forward_mamba2(
                xbc, conv_weight, conv_bias, dt, dt_bias, A, D, state, backend.build_metadata(common)
            )
        assert all(torch.equal(a, b) for a, b in zip(inputs, copies)), f"{label}: forward_mamba2 modified its inputs"
        assert torch.equal(state[others], before), (
            f"{label}: slots {others} are not the step's (its sequences use {[slots[b] for b in seqs]}), "
            "but forward_mamba2 changed them"
        )
        if not check_output:
            return
        expected_shape = (sum(news), spec.num_heads, spec.head_size)
        assert tuple(out.shape) == expected_shape and out.dtype == torch.float32, (
            f"{label}: output {out.dtype} {tuple(out.shape)}, expected torch.float32 {expected_shape}"
        )
        expected = rows(case.y)
        bounds = [0, *torch.tensor(news).cumsum(0).tolist()]
        errors = [
            (b, s, n, round(float((out[r0:r1].float().cpu() - expected[r0:r1]).abs().max()), 6))
            for b, s, n, r0, r1 in zip(seqs, starts, news, bounds, bounds[1:])
        ]
        torch.testing.assert_close(
            out.float().cpu(),
            expected,
            atol=atol,
            rtol=rtol,
            msg=lambda m: f"{label}: (seq, cached, new, max abs err) = {errors}\n{m}",
        )
