"""``PlatformTests``: what the engine relies on from a platform, checked on it."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest

from engine.testing.kit.base import KitTests, capability_skip

# ``‖y − y_ref‖ / ‖y_ref‖`` a faster linear method may reach against fp32 ``F.linear`` on the same
# (rounded) inputs: the dtype's rounding of the output and of a reordered sum (fp32: TF32 allowed)
LINEAR_ERROR_BOUNDS = {"float32": 2e-3, "bfloat16": 2e-2, "float16": 4e-3}
# assert_close tolerances of fused layer ops against the reference ops in the same dtype
OPS_TOLERANCES = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3)}


class PlatformTests(KitTests):
    """Subclass with ``plugin`` (the providing plugin) and ``platform_name`` (its
    registered name). Checks that need the platform's device skip when
    ``is_available()`` says no, with its reason."""

    registry_name = "platforms"
    platform_name: ClassVar[str | None] = None

    def platform_class(self) -> Any:
        return self.resolve(self.required("platform_name"))

    def available_platform(self) -> Any:
        cls = self.platform_class()
        availability = cls.is_available()
        if not availability:
            pytest.skip(f"platform {cls.name} is not available here: {availability.reason}")
        return cls()

    def test_discoverable(self) -> None:
        """The plugin registers the platform under its declared name (or ``platform_name`` is its
        ``module.path:Class``), as an engine Platform."""
        from engine.interfaces.platform import Platform

        cls = self.platform_class()
        assert isinstance(cls, type) and issubclass(cls, Platform), cls
        self.assert_named(cls, self.platform_name)

    def test_availability_answers_with_a_reason(self) -> None:
        """``is_available()`` never raises and always says why."""
        cls = self.platform_class()
        try:
            availability = cls.is_available()
        except Exception as exc:  # noqa: BLE001 - any exception breaks the contract
            pytest.fail(
                f"{cls.__name__}.is_available() raised {exc!r}; it must return Availability(False, reason) instead"
            )
        assert isinstance(availability.available, bool), f"is_available() gave {availability!r}, not a bool answer"
        assert isinstance(availability.reason, str) and availability.reason.strip(), (
            f"is_available() gave {availability!r} without a reason"
        )

    def test_declared_dtypes_work(self) -> None:
        """Every declared dtype can hold values on the device and multiply matrices correctly."""
        import torch

        platform = self.available_platform()
        assert platform.supported_dtypes, "a platform must declare at least one dtype"
        for name in platform.supported_dtypes:
            dtype = getattr(torch, name)
            a = torch.arange(16, dtype=torch.float32).reshape(4, 4)
            expected = a @ a.T
            got = (a.to(platform.device(), dtype) @ a.to(platform.device(), dtype).T).float().cpu()
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2, msg=f"matmul in {name}")

    def test_backend_preferences_resolve_to_registered_backends(self) -> None:
        """Each backend the platform prefers for a kind is registered (by some loaded plugin)
        and declares that kind and this platform."""
        platform = self.platform_class()()
        preferences = getattr(type(platform), "attention_backends", {}) or {}
        if not preferences:
            capability_skip("attention backend preferences")
        components = self.components()
        for kind in preferences:
            for name in platform.attention_backend_preferences(kind):
                backend = components.attention_backends.get(name)
                assert kind in backend.capabilities.kinds, f"{name} does not declare kind {kind}"
                assert platform.name in backend.capabilities.platforms, f"{name} does not declare {platform.name}"

    def test_memory_info_is_plausible(self) -> None:
        """Free and total memory are whole bytes, the free ones positive and at most the total."""
        info = self.available_platform().memory_info()
        assert isinstance(info.free_bytes, int) and isinstance(info.total_bytes, int), (
            f"memory_info() gave {info!r}: free_bytes and total_bytes must be ints (bytes)"
        )
        assert 0 < info.free_bytes <= info.total_bytes, (
            f"memory_info() gave {info.free_bytes} free of {info.total_bytes} bytes: free must be positive "
            f"and at most the total"
        )

    def test_default_kv_cache_fits_in_free_memory(self) -> None:
        """``default_kv_cache_bytes()`` (the KV cache when the user sets no size) is positive and at
        most the free memory ``memory_info()`` reports."""
        platform = self.available_platform()
        default, free = platform.default_kv_cache_bytes(), platform.memory_info().free_bytes
        assert isinstance(default, int) and 0 < default <= free, (
            f"default_kv_cache_bytes() is {default!r}, with {free} bytes free: it must be a positive int "
            f"no larger than the free memory"
        )

    def test_memory_stats_count_what_is_allocated(self) -> None:
        """Where ``memory_stats`` answers: a tensor allocated after ``reset_peak_memory`` raises
        the live bytes by at least its size, and the peak is never below the live bytes."""
        import torch

        platform = self.available_platform()
        if platform.memory_stats() is None:
            capability_skip("memory_stats")
        platform.synchronize()
        platform.reset_peak_memory()
        before, _ = platform.memory_stats()
        held = torch.empty(4 << 20, dtype=torch.uint8, device=platform.device())
        platform.synchronize()
        allocated, peak = platform.memory_stats()
        assert allocated - before >= held.numel(), f"allocated rose by {allocated - before} bytes for {held.numel()}"
        assert peak >= allocated, f"peak {peak} below the live bytes {allocated}"
        del held

    def test_seeding_makes_sampling_reproducible(self) -> None:
        """``seed_everything`` fixes torch's random streams on the device, and the seed decides
        them: seeding 1234 twice gives the same draws, seeding 4321 others."""
        import torch

        platform = self.available_platform()
        platform.seed_everything(1234)
        first = torch.rand(8, device=platform.device()).cpu()
        platform.seed_everything(1234)
        again = torch.rand(8, device=platform.device()).cpu()
        assert torch.equal(first, again), "seed_everything(1234) twice gave different draws"
        platform.seed_everything(4321)
        other = torch.rand(8, device=platform.device()).cpu()
        assert not torch.equal(first, other), "seed_everything(1234) and seed_everything(4321) gave the same draws"

    def test_kv_cache_allocation(self) -> None:
        """``allocate_kv_cache`` gives a zero-filled contiguous tensor of the shape and dtype asked,
        on the device, for every declared dtype and two shapes."""
        import torch

        platform = self.available_platform()
        for name in platform.supported_dtypes:
            dtype = getattr(torch, name)
            for shape in ((2, 3, 16, 2, 8), (5, 4, 1, 32)):
                cache = platform.allocate_kv_cache(shape, dtype)
                asked = f"allocate_kv_cache({shape}, {dtype})"
                assert tuple(cache.shape) == shape, f"{asked} gave shape {tuple(cache.shape)}"
                assert cache.dtype == dtype, f"{asked} gave dtype {cache.dtype}"
                assert cache.is_contiguous(), f"{asked} gave a non-contiguous tensor (strides {cache.stride()})"
                assert cache.device.type == platform.device().type, f"{asked} gave a tensor on {cache.device}"
                assert not cache.view(torch.uint8).any(), f"{asked} gave a tensor that is not zero-filled"

    def test_linear_method_matches_f_linear(self) -> None:
        """Where ``linear_method(dtype)`` gives a method: layers of 64 → 96 outputs with a bias
        and 256 → 48 without, switched to it after their weights load (as the engine does),
        give ``F.linear``'s output within the dtype's rounding for 1, 7 and 40 tokens."""
        import torch
        import torch.nn.functional as F

        from engine.layers.linear import Linear, apply_linear_method

        platform = self.available_platform()
        methods = {name: platform.linear_method(name) for name in platform.supported_dtypes}
        if not any(methods.values()):
            capability_skip("linear_method")
        generator = torch.Generator().manual_seed(0)
        device = platform.device()
        for name, method in methods.items():
            if method is None:
                continue
            dtype = getattr(torch, name)
            for input_size, output_size, bias in ((64, 96, True), (256, 48, False)):
                with torch.device(device):
                    layer = Linear(input_size, output_size, bias, dtype)
                weight = torch.randn(output_size, input_size, generator=generator) * input_size**-0.5
                with torch.no_grad():
                    layer.weight.copy_(weight)
                    if bias:
                        layer.bias.copy_(torch.randn(output_size, generator=generator))
                weight, bias_value = layer.weight.float().cpu(), layer.bias.float().cpu() if bias else None
                apply_linear_method(layer, method)
                for num_tokens in (1, 7, 40):
                    x = torch.randn(num_tokens, input_size, generator=generator).to(dtype)
                    expected = F.linear(x.float(), weight, bias_value)
                    got = layer.forward(x.to(device))
                    assert got.dtype == dtype and got.shape == expected.shape, (
                        f"{name} linear method gave {got.dtype} {tuple(got.shape)} for {tuple(expected.shape)}"
                    )
                    error = ((got.float().cpu() - expected).norm() / expected.norm()).item()
                    assert error <= LINEAR_ERROR_BOUNDS.get(name, 2e-2), (
                        f"{name} linear method ({type(method).__name__}), {input_size} -> {output_size} "
                        f"{'with' if bias else 'without'} bias, {num_tokens} tokens: relative error {error:.3g} "
                        f"against F.linear"
                    )

    def test_linear_method_gate_up_gives_silu_times_up(self) -> None:
        """Where ``linear_method(dtype)`` gives a method: a gated MLP's gate/up layer (two shards
        of 64, and of 40, from 256 inputs), switched to it after loading, gives silu(gate) * up
        through ``forward_silu_and_mul`` (the method's ``apply_silu_and_mul`` where it has one)
        within the dtype's rounding of the float32 product, for 1, 7 and 40 tokens."""
        import torch
        import torch.nn.functional as F

        from engine.interfaces.ops import REFERENCE_OPS
        from engine.layers.linear import MergedLinear, apply_linear_method

        platform = self.available_platform()
        methods = {name: platform.linear_method(name) for name in platform.supported_dtypes}
        if not any(methods.values()):
            capability_skip("linear_method")
        generator = torch.Generator().manual_seed(1)
        device = platform.device()
        for name, method in methods.items():
            if method is None:
                continue
            dtype = getattr(torch, name)
            ops = platform.layer_ops(name) or REFERENCE_OPS
            for half in (64, 40):
                with torch.device(device):
                    layer = MergedLinear(256, [half, half], False, dtype)
                weight = torch.randn(2 * half, 256, generator=generator) * 256**-0.5
                with torch.no_grad():
                    layer.weight.copy_(weight)
                weight = layer.weight.float().cpu()
                apply_linear_method(layer, method)
                for num_tokens in (1, 7, 40):
                    x = torch.randn(num_tokens, 256, generator=generator).to(dtype)
                    product = F.linear(x.float(), weight)
                    expected = F.silu(product[:, :half]) * product[:, half:]
                    got = layer.forward_silu_and_mul(x.to(device), ops)
                    assert got.dtype == dtype and got.shape == expected.shape, (
                        f"{name} gate/up gave {got.dtype} {tuple(got.shape)} for {tuple(expected.shape)}"
                    )
                    error = ((got.float().cpu() - expected).norm() / expected.norm()).item()
                    assert error <= 2 * LINEAR_ERROR_BOUNDS.get(name, 2e-2), (
                        f"{name} linear method ({type(method).__name__}), gate/up of 2 x {half}, {num_tokens} "
                        f"tokens: relative error {error:.3g} against silu(gate) * up in float32"
                    )

    def test_layer_ops_match_the_reference(self) -> None:
        """Where ``layer_ops(dtype)`` gives fused ops: RMSNorm (with and without the residual
        add), rotary (whole and partial rotary dims), SiLU-and-mul, the group-quantized linear
        layer (``group_quant_linear``), the FP8 linear layer (``fp8_linear``) and the token bitmask give the
        reference ops' values within the dtype's rounding, and ``argmax`` equals ``torch.argmax``
        exactly (the first of equal maxima, a NaN counting as the maximum)."""
        platform = self.available_platform()
        all_ops = {name: platform.layer_ops(name) for name in platform.supported_dtypes}
        if not any(all_ops.values()):
            capability_skip("layer_ops")
        for name, ops in all_ops.items():
            if ops is not None:
                self.check_layer_ops(ops, name, platform.device())

    def check_group_quant_linear(self, ops: Any, rand: Any, close: Any, device: Any) -> None:
        """``group_quant_linear`` against the reference for 4-, 6- and 8-bit weights (groups of 16, 32
        and 128, one- and two-level scales, an input order, a bias), one and several rows. With 16-bit x the kernel may round x to
        int8 in blocks of up to 128 inputs of a group (``LayerOps.group_quant_linear``): the
        difference it may add, ``(dx / 2) @ |s q|^T`` with ``dx`` each block's max|x| / 127, is
        allowed on top of the dtype's tolerance. In float32, the sums' own rounding in another
        order than the reference's (``2 K 2^-24 |x| @ |s q|^T``), which an output near zero
        shows beyond the dtype's tolerance, is allowed on top of it."""
        import torch

        from engine.interfaces.group_quant import quantize_groups
        from engine.interfaces.ops import REFERENCE_OPS
        from engine.testing.oracles import group_quant_int8_allowance, group_quant_sum_allowance

        def within(got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: Any, what: str) -> None:
            if x.dtype == torch.float32:
                allowed = group_quant_sum_allowance(x.float(), weight).float()
            else:
                allowed = group_quant_int8_allowance(x.float(), weight, min(weight.group_size, 128)).float()
            close(got, expected + (got.float().cpu() - expected.float().cpu()).clamp(-allowed, allowed), what)

        generator = torch.Generator().manual_seed(1)
        # (bits, group size, input order, groups a super-block: two-level scales as GGUF's k-quants)
        layouts = ((4, 32, False, 0), (8, 16, True, 0), (4, 128, True, 0), (4, 32, False, 4), (6, 16, True, 8))
        for bits, group_size, ordered, super_group in layouts:
            weight = quantize_groups(
                torch.randn(40, 128, generator=generator), bits, group_size, super_group=super_group
            )
            if ordered:
                weight = dataclasses.replace(weight, input_order=torch.randperm(128, generator=generator))
            weight = weight.to(device)
            bias = rand(40)
            for rows in (1, 9):
                x = rand(rows, 128)
                for b in (None, bias):
                    within(
                        ops.group_quant_linear(x, weight, b),
                        REFERENCE_OPS.group_quant_linear(x, weight, b).float().cpu(),
                        x,
                        weight,
                        f"group_quant_linear ({bits}-bit, groups of {group_size}, {rows} rows, "
                        f"{f'{super_group} a super-block, ' if super_group else ''}"
                        f"{'input order, ' if ordered else ''}{'bias' if b is not None else 'no bias'})",
                    )

    def check_layer_ops(self, ops: Any, name: str, device: Any) -> None:
        """``ops`` (a platform's ``layer_ops(name)``) against the reference ops, on ``device``."""
        import torch

        from engine.interfaces.ops import REFERENCE_OPS

        generator = torch.Generator().manual_seed(0)
        dtype = getattr(torch, name)
        rtol, atol = OPS_TOLERANCES.get(name, (2e-2, 2e-2))

        def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * scale + shift).to(device, dtype)

        def close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
            torch.testing.assert_close(
                got.float().cpu(), expected.float().cpu(), rtol=rtol, atol=atol, msg=f"{name} {what}"
            )

        x, residual, weight = rand(7, 64), rand(7, 64), rand(64, scale=0.1, shift=1.0)
        close(ops.rms_norm(x.clone(), weight, 1e-5), REFERENCE_OPS.rms_norm(x, weight, 1e-5), "rms_norm")
        got, got_residual = ops.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        expected, expected_residual = REFERENCE_OPS.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        close(got, expected, "add_rms_norm (normalised)")
        close(got_residual, expected_residual, "add_rms_norm (residual)")
        q, k = rand(7, 4, 64), rand(7, 2, 64)
        for rotary_dim in (64, 32):
            angles = torch.outer(torch.arange(3, 10).float(), 0.5 ** torch.arange(rotary_dim // 2).float())
            cos = torch.cat((angles, angles), dim=-1).cos().to(device, dtype)
            sin = torch.cat((angles, angles), dim=-1).sin().to(device, dtype)
            got_q, got_k = ops.rotary(q.clone(), k.clone(), cos, sin)
            expected_q, expected_k = REFERENCE_OPS.rotary(q.clone(), k.clone(), cos, sin)
            close(got_q, expected_q, f"rotary q (rotary_dim {rotary_dim})")
            close(got_k, expected_k, f"rotary k (rotary_dim {rotary_dim})")
        gate_up = rand(7, 256)
        close(ops.silu_and_mul(gate_up.clone()), REFERENCE_OPS.silu_and_mul(gate_up), "silu_and_mul")
        self.check_group_quant_linear(ops, rand, close, device)
        # fp8_linear: finite e4m3 bytes (subnormals included), a scale per row and 64 inputs (the
        # last block cut short), one and several rows, with and without a bias. With 16-bit x a
        # kernel may round the dequantized weight to x's dtype: up to 2^-8 of |x| @ |W s|^T more.
        codes = torch.randint(0, 256, (40, 200), generator=generator, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN
        weight = codes.view(torch.float8_e4m3fn).to(device)
        scales = (torch.rand(40, 4, generator=generator) * 0.01 + 1e-4).to(device)
        dense = weight.float().cpu() * scales.cpu().repeat_interleave(64, dim=1)[:, :200]
        for rows in (1, 12):
            x = rand(rows, 200)
            allowed = 0.0 if dtype == torch.float32 else (x.float().cpu().abs() @ dense.abs().T) * 2.0**-8
            for b in (None, rand(40)):
                got = ops.fp8_linear(x, weight, scales, 64, b).float().cpu()
                expected = REFERENCE_OPS.fp8_linear(x, weight, scales, 64, b).float().cpu()
                close(
                    got,
                    expected + (got - expected).clamp(-allowed, allowed),
                    f"fp8_linear ({rows} rows, {'bias' if b is not None else 'no bias'})",
                )
        logits = rand(4, 100).float()
        bitmask = torch.randint(-(2**31), 2**31, (2, 4), generator=generator, dtype=torch.int64).to(torch.int32)
        rows = torch.tensor([2, 0])
        got, expected = logits.clone(), logits.clone()
        ops.apply_token_bitmask(got, bitmask.to(device), rows.to(device))
        REFERENCE_OPS.apply_token_bitmask(expected, bitmask.to(device), rows.to(device))
        assert torch.equal(got.cpu(), expected.cpu()), f"{name} apply_token_bitmask differs from the reference"
        logits = rand(4, 1000)
        top = logits.float().max().item() + 1
        logits[1, 10] = logits[1, 500] = top  # equal maxima: the first wins
        logits[2, 300] = float("nan")  # a NaN counts as the maximum
        got = ops.argmax(logits).cpu()
        assert torch.equal(got, logits.argmax(dim=-1).cpu()), (
            f"{name} argmax gave {got.tolist()}, torch.argmax {logits.argmax(dim=-1).cpu().tolist()}"
        )
