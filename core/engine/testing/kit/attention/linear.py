"""Checks of linear attention, Kimi delta attention (kind ``linear``,
:class:`engine.interfaces.attention.LinearAttentionBackend`): each request's state continued in
its slot, against the token-by-token :func:`engine.testing.oracles.naive_kda`."""

from __future__ import annotations

import zlib

import pytest
import torch

from engine.interfaces.attention import LINEAR, AttentionSpec
from engine.testing.kit.attention.base import BATCHES, AttentionKitBase, make_common_metadata, random_batch
from engine.testing.oracles import naive_kda

# linear attention: (heads, head_size, value_size, convolution kernel)
LINEAR_SHAPES = {"h1": (1, 8, 8, 2), "h2": (2, 16, 8, 4), "h4": (4, 8, 16, 3)}
# "long": two sequences fed in chunks of these sizes, step by step (crossing 64-token chunks)
LONG_CHUNKS = ([64, 1, 5, 70], [5, 64, 1, 9])


class LinearChecks(AttentionKitBase):
    """``test_linear``."""

    @pytest.mark.parametrize("shape", list(LINEAR_SHAPES))
    @pytest.mark.parametrize("batch", [*BATCHES, "long", "tokens"])
    def test_linear(self, batch: str, shape: str, dtype: str, engine_device: str) -> None:
        """Kimi delta attention (``forward_linear``) continuing each request's state in its slot
        (slots shuffled, stale values in the fresh ones): a prefill of the prefixes, the new
        tokens after them and a decode each with the rows reversed; or two long sequences fed in
        chunks of 64, 1, 5 and 70 tokens; or ("tokens") one-token steps where sequences start
        fresh beside others that continue, then a chunk. Every step's output matches the
        token-by-token oracle over the whole sequence."""
        self.check_linear_case(batch, shape, dtype, engine_device)

    def check_linear_case(self, batch: str, shape: str, dtype: str, engine_device: str) -> None:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{LINEAR}/{batch}/{shape}".encode()))
        cls, device = self.setup_backend(LINEAR, dtype, engine_device, 16)
        heads, head_size, value_size, kernel = LINEAR_SHAPES[shape]
        scale = head_size**-0.5 * (0.5 + float(torch.rand((), generator=gen)))
        spec = AttentionSpec(LINEAR, heads, heads, head_size, scale, value_size=value_size, conv_kernel=kernel)
        torch_dtype = getattr(torch, dtype)
        backend = cls(spec, 16, torch_dtype, device)
        if batch == "long":
            steps = [list(enumerate(step)) for step in zip(*LONG_CHUNKS)]  # per step: [(seq, new tokens)]
            lengths = [sum(sizes) for sizes in LONG_CHUNKS]
        elif batch == "tokens":  # decode-shaped steps (one token a sequence) with fresh sequences among them
            steps = [[(0, 1)], [(0, 1), (1, 1)], [(2, 1), (1, 1), (0, 1)], [(2, 4), (1, 1)], [(0, 1), (2, 1)]]
            lengths = [4, 3, 6]
        else:
            context_lens, query_lens = random_batch(batch, gen)
            lengths = [c + n + 1 for c, n in zip(context_lens, query_lens)]
            order = list(reversed(range(len(lengths))))
            steps = [
                [(b, c) for b, c in enumerate(context_lens) if c > 0],
                list(enumerate(query_lens)),
                [(b, 1) for b in order],
            ]
        num_slots = len(lengths) + 3
        slots = torch.randperm(num_slots, generator=gen)[: len(lengths)].tolist()
        state = torch.randn(backend.kv_cache_shape(num_slots), generator=gen)  # stale: fresh sequences ignore it
        state = state.to(backend.cache_dtype(torch_dtype)).to(device)
        channels = spec.conv_channels
        conv_weight = (0.5 * torch.randn(channels, kernel, generator=gen)).to(torch_dtype).to(device)
        mixed = [torch.randn(n, channels, generator=gen).to(torch_dtype).to(device) for n in lengths]
        g = [(-0.3 * torch.randn(n, heads, head_size, generator=gen).exp()).to(device) for n in lengths]
        beta = [torch.rand(n, heads, generator=gen).to(device) for n in lengths]
        done = [0] * len(lengths)
        (atol, rtol) = self.tolerances[dtype]
        atol, rtol = max(atol, 1e-4), max(rtol, 1e-4)  # a chunked form sums in another order
        for index, step in enumerate(steps):
            if not step:
                continue
            seqs, news = [b for b, _ in step], [n for _, n in step]
            starts = [done[b] for b in seqs]
            tables = [[0] * -(-(s + n) // 16) for s, n in zip(starts, news)]  # no per-token cache: any blocks
            common = make_common_metadata(starts, news, tables, 16, device, [slots[b] for b in seqs])

            def rows(per_seq, seqs=seqs, starts=starts, news=news):
                return torch.cat([per_seq[b][s : s + n] for b, s, n in zip(seqs, starts, news)])

            inputs = [rows(mixed), rows(g), rows(beta)]
            copies = [t.clone() for t in inputs]
            with torch.inference_mode():
                out = backend.forward_linear(
                    inputs[0], conv_weight, inputs[1], inputs[2], state, backend.build_metadata(common)
                )
            label = f"step {index + 1} of {batch} ({spec})"
            assert all(torch.equal(a, b) for a, b in zip(inputs, copies)), (
                f"{label}: forward_linear modified its inputs"
            )
            expected_shape = (sum(news), heads, value_size)
            assert tuple(out.shape) == expected_shape and out.dtype == torch_dtype, (
                f"{label}: output {out.dtype} {tuple(out.shape)}, expected {torch_dtype} {expected_shape}"
            )
            expected = torch.cat(
                [
                    naive_kda(
                        mixed[b][: s + n].cpu(),
                        conv_weight.cpu(),
                        g[b][: s + n].cpu(),
                        beta[b][: s + n].cpu(),
                        heads,
                        head_size,
                        value_size,
                        scale,
                    )[s:]
                    for b, s, n in zip(seqs, starts, news)
                ]
            )
            torch.testing.assert_close(
                out.float().cpu(),
                expected,
                atol=atol,
                rtol=rtol,
                msg=lambda m, label=label, step=step: f"{label}: (seq, cached, new) = {step}\n{m}",
            )
            for b, n in step:
                done[b] += n
