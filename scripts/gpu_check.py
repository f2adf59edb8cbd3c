"""The GPU acceptance run: the engine's Triton kernels natively on a CUDA or ROCm GPU against
their torch references (error and time; the group-quantized linear kernel's time against
F.linear on the weight dequantized beforehand); the decode-attention kernel's HBM bandwidth at 1k,
8k and 32k context against the device's measured copy bandwidth; the engine's prompt logits
against transformers' on the same GPU for the tiny Llama, DeepSeek-V3/V4 and Kimi-Linear
checkpoints and DeepSeek-V3 in FP8 (FP8 linear layers), and llama58m's greedy tokens
against transformers' ``generate``; the engine on the GPU with
CUDA graphs and async scheduling on and off (identical greedy outputs, the batch-1 step each
way); and ``engine bench latency`` / ``throughput`` with HF transformers on the same GPU.
Prints each figure and writes them all to one JSON file.

    python scripts/gpu_check.py [--json gpu_check.json] [--no-bench]   # needs torch with CUDA or HIP and triton
    python scripts/gpu_check.py --models-on-cpu                        # the model checks alone, on the CPU

The same kernels are tested on the CPU under the Triton interpreter by the test suite; this
script checks them compiled, at shapes closer to real models, and says how fast they are.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

RESULTS: dict = {"kernels": {}}


def timed(fn, repeat: int = 20) -> tuple[object, float]:
    """(fn's result, its median time in milliseconds over ``repeat`` runs after a warm-up)."""
    result = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return result, sorted(times)[len(times) // 2]


def report(name: str, got: torch.Tensor, expected: torch.Tensor, ms: float, ref_ms: float) -> bool:
    error = (got.float() - expected.float()).abs().max().item()
    ok = error <= 1e-2 * max(1.0, expected.float().abs().max().item())
    print(f"{name:38s} max err {error:9.2e}  triton {ms:8.3f} ms  torch {ref_ms:8.3f} ms  {'ok' if ok else 'FAIL'}")
    RESULTS["kernels"][name] = {"ok": ok, "max_error": error, "triton_ms": ms, "torch_ms": ref_ms}
    return ok


def check_paged_attention(device) -> bool:
    from engine.kernels.paged_attention import paged_attention

    gen = torch.Generator(device="cpu").manual_seed(0)
    num_seqs, seq_len, heads, kv_heads, head_size, block_size = 8, 1024, 32, 8, 128, 16
    blocks = num_seqs * seq_len // block_size
    k_cache = torch.randn(blocks, block_size, kv_heads, head_size, generator=gen).to(device, torch.bfloat16)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_size, generator=gen).to(device, torch.bfloat16)
    tables = torch.randperm(blocks, generator=gen).view(num_seqs, -1).to(device)
    q = torch.randn(num_seqs, heads, head_size, generator=gen).to(device, torch.bfloat16)  # one decode token each
    token_seq = torch.arange(num_seqs, device=device)
    token_pos = torch.full((num_seqs,), seq_len - 1, device=device)
    scale = head_size**-0.5

    def reference():
        pos = torch.arange(seq_len, device=device)
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
        keys = k_cache.view(-1, kv_heads, head_size)[slots].transpose(1, 2)  # [B, Hkv, L, D]
        values = v_cache.view(-1, kv_heads, head_size)[slots].transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], keys, values, scale=scale, enable_gqa=True
        )[:, :, 0]

    got, ms = timed(lambda: paged_attention(q, k_cache, v_cache, head_size, tables, token_seq, token_pos, scale, None))
    expected, ref_ms = timed(reference)
    return report("paged attention decode (GQA 32/8, 1k)", got, expected, ms, ref_ms)


def check_kda(device) -> bool:
    from engine.kernels.kda import kda_chunked, kda_recurrent
    from engine.kernels.kda_torch import chunked, l2_normalize

    gen = torch.Generator(device="cpu").manual_seed(1)
    num_seqs, rows, heads, dk = 4, 512, 16, 128
    q = (l2_normalize(torch.randn(num_seqs, rows, heads, dk, generator=gen)) * dk**-0.5).to(device)
    k = l2_normalize(torch.randn(num_seqs, rows, heads, dk, generator=gen)).to(device)
    v = torch.randn(num_seqs, rows, heads, dk, generator=gen).to(device)
    g = (-0.1 * torch.randn(num_seqs, rows, heads, dk, generator=gen).exp()).to(device)
    beta = torch.rand(num_seqs, rows, heads, generator=gen).to(device)
    state = torch.zeros(num_seqs, heads, dk, dk, device=device)
    lengths = torch.full((num_seqs,), rows, device=device)
    expected, ref_ms = timed(lambda: chunked(q, k, v, g, beta, state.clone())[0], repeat=5)
    ok = True
    for name, kernel in (
        ("KDA chunked prefill (4 x 512, 16 heads)", kda_chunked),
        ("KDA recurrent (4 x 512, 16 heads)", kda_recurrent),
    ):
        got, ms = timed(lambda kernel=kernel: kernel(q, k, v, g, beta, state.clone(), lengths), repeat=5)
        ok &= report(name, got, expected, ms, ref_ms)
    return ok


def check_mamba2(device) -> bool:
    from engine.kernels.mamba2 import mamba2_chunked, mamba2_recurrent
    from engine.kernels.mamba2_torch import chunked

    gen = torch.Generator(device="cpu").manual_seed(2)
    num_seqs, rows, heads, head_size, state_size, groups = 4, 512, 24, 64, 128, 1
    x = torch.randn(num_seqs, rows, heads, head_size, generator=gen).to(device)
    delta = (0.1 * torch.rand(num_seqs, rows, heads, generator=gen) + 0.001).to(device)
    A = -(torch.rand(heads, generator=gen) * 4 + 0.5).to(device)
    b = torch.randn(num_seqs, rows, groups, state_size, generator=gen).to(device)
    c = torch.randn(num_seqs, rows, groups, state_size, generator=gen).to(device)
    D = torch.randn(heads, generator=gen).to(device)
    state = torch.zeros(num_seqs, heads, head_size, state_size, device=device)
    lengths = torch.full((num_seqs,), rows, device=device)
    expected, ref_ms = timed(lambda: chunked(x, delta, A, b, c, D, state.clone())[0], repeat=5)
    ok = True
    for name, kernel in (
        ("Mamba-2 chunked prefill (4 x 512, 24 heads)", mamba2_chunked),
        ("Mamba-2 recurrent (4 x 512, 24 heads)", mamba2_recurrent),
    ):
        got, ms = timed(lambda kernel=kernel: kernel(x, delta, A, b, c, D, state.clone(), lengths), repeat=5)
        ok &= report(name, got, expected, ms, ref_ms)
    return ok


def check_moe(device) -> bool:
    from engine.kernels.moe import fused_moe
    from engine.layers.moe import Experts
    from engine.runtime.forward_context import ForwardContext

    gen = torch.Generator(device="cpu").manual_seed(2)
    tokens, experts, top_k, hidden, inter = 512, 64, 8, 2048, 768
    module = Experts(experts, inter, hidden, torch.bfloat16).to(device)
    with torch.no_grad():
        module.w13.copy_(torch.randn(module.w13.shape, generator=gen) / hidden**0.5)
        module.w2.copy_(torch.randn(module.w2.shape, generator=gen) / inter**0.5)
    x = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, top_k, generator=gen).to(device)
    ctx = ForwardContext(backends=[], kv_caches=[], metadata=[])
    expected, ref_ms = timed(lambda: module(x, ids, weights, ctx), repeat=5)
    got, ms = timed(lambda: fused_moe(x, module.w13, module.w2, ids, weights), repeat=5)
    return report("fused MoE (512 tokens, 64 experts, top 8)", got, expected, ms, ref_ms)


def check_fp8_gemm(device) -> bool:
    from engine_cuda.fp8_gemm import fp8_block_linear, quantize_fp8_groups

    if torch.cuda.get_device_capability(device) < (8, 9):
        print("FP8 GEMM: skipped (needs compute capability 8.9+)")
        return True
    gen = torch.Generator(device="cpu").manual_seed(0)
    m, n, k = 64, 4096, 7168  # a DeepSeek-V3 projection's shape
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n // 128, k // 128, generator=gen) / 64 + 1e-3
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    weight, scales, x = weight.to(device), scales.to(device), x.to(device)
    q, x_scales = quantize_fp8_groups(x, 128)
    x_ref = (q.float().view(m, k // 128, 128) * x_scales[:, :, None]).view(m, k)
    w_ref = (weight.float().view(n // 128, 128, k // 128, 128) * scales[:, None, :, None]).view(n, k)

    expected, ref_ms = timed(lambda: (x_ref @ w_ref.T).to(torch.bfloat16), repeat=10)
    got, ms = timed(lambda: fp8_block_linear(x, weight, scales, (128, 128), block_k=128), repeat=10)
    return report("FP8 block GEMM W8A8 (64x4096x7168)", got, expected, ms, ref_ms)


def check_fp8_layer_ops(device) -> bool:
    """engine-cuda's layer ops' fp8_linear (what FP8 routed experts compute with): bf16
    activations on the Triton GEMM against the dequantized product, at an expert's shape."""
    from engine.interfaces.ops import REFERENCE_OPS
    from engine_cuda.layer_ops import CudaLayerOps

    if torch.cuda.get_device_capability(device) < (8, 9):
        print("FP8 layer ops: skipped (needs compute capability 8.9+)")
        return True
    gen = torch.Generator(device="cpu").manual_seed(1)
    m, n, k = 16, 2048, 7168  # a token batch through one DeepSeek-V3 routed expert's gate/up
    weight = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
    scales = (torch.rand(n, k // 128, generator=gen) / 64 + 1e-3).to(device)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
    ops = CudaLayerOps()
    expected, ref_ms = timed(lambda: REFERENCE_OPS.fp8_linear(x, weight, scales, 128), repeat=10)
    got, ms = timed(lambda: ops.fp8_linear(x, weight, scales, 128), repeat=10)
    return report("FP8 layer ops bf16 (16x2048x7168)", got, expected, ms, ref_ms)


GROUP_QUANT_LAYERS = {"gate_up": (2816, 512), "down": (512, 1408)}  # llama58m's MLP: (N, K)
# (bits, group size, groups a super-block, symmetric): GPTQ/AWQ int4 (asymmetric), GGUF Q8_0
# (a zero), Q4_K (two levels), Q6_K (6 bits, two levels, a zero) and MXFP4 (6-bit doubled e2m1
# values, one scale per 32, a zero)
GROUP_QUANT_FORMATS = ((4, 128, 0, False), (8, 32, 0, True), (4, 32, 8, False), (6, 16, 16, True), (6, 32, 0, True))
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def check_group_quant(device, rows: tuple[int, ...] = (1, 256), repeat: int = 20) -> bool:
    """The group-quantized linear kernel (engine.kernels.group_quant) against the torch reference
    on the device, for llama58m's MLP shapes in bf16 and fp16, decode (1 row, also without
    split-K) and prefill; the time column is F.linear with the weight dequantized beforehand."""
    from engine.interfaces.group_quant import group_quant_linear, quantize_groups
    from engine.kernels.group_quant import triton_group_quant_linear

    gen = torch.Generator(device="cpu").manual_seed(3)
    ok = True
    for dtype in (torch.bfloat16, torch.float16):
        for layer, (n, k) in GROUP_QUANT_LAYERS.items():
            dense = torch.randn(n, k, generator=gen) / k**0.5
            for bits, group_size, super_group, symmetric in GROUP_QUANT_FORMATS:
                weight = quantize_groups(dense, bits, group_size, super_group=super_group, symmetric=symmetric)
                weight = weight.to(device)
                dequantized = weight.dequantize(dtype)
                for m in rows:
                    x = torch.randn(m, k, generator=gen).to(device, dtype)
                    expected = group_quant_linear(x, weight)
                    _, ref_ms = timed(lambda x=x, d=dequantized: torch.nn.functional.linear(x, d), repeat=repeat)
                    layout = f"int{bits}/g{group_size}" + (f"/s{super_group}" if super_group else "")
                    name = f"{layout}{'/sym' if symmetric else ''} {layer} {DTYPE_NAMES[dtype]} {m}x{n}x{k}"
                    got, ms = timed(lambda x=x, w=weight: triton_group_quant_linear(x, w), repeat=repeat)
                    ok &= report(name, got, expected, ms, ref_ms)
                    if m == 1:
                        got, ms = timed(lambda x=x, w=weight: triton_group_quant_linear(x, w, split=1), repeat=repeat)
                        ok &= report(f"{name} no split-K", got, expected, ms, ref_ms)
    return ok


def check_decode_graphs(device) -> bool:
    """The engine on the GPU with llama58m (the benchmark model): greedy outputs identical with
    CUDA graphs on and off and async scheduling on and off, and the batch-1 decode step's time
    each way."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    outputs, steps = {}, {}
    platform = "rocm" if torch.version.hip else "cuda"
    for name, settings in {
        "graphs": {},
        "eager": {"enforce_eager": True},
        "graphs, no async": {"async_scheduling": False},
    }.items():
        llm = LLM("llama58m", plugins=[platform, "llama"], dtype="bfloat16", progress=False, max_num_seqs=8, **settings)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm.engine
        engine.add_request("timed", prompts[0], params)
        times = []
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000)
        steps[name] = sorted(times[2:])[len(times[2:]) // 2]
        del llm, engine
    same = all(o == outputs["eager"] for o in outputs.values())
    RESULTS["decode_graphs"] = {
        "identical_outputs": same,
        "batch1_step_ms": steps,
        "eager_over_graphs": steps["eager"] / steps["graphs"],
        "graphs_at_least_2x": steps["eager"] / steps["graphs"] >= 2.0,
    }
    print(
        "decode graphs: outputs "
        + ("identical" if same else "DIFFER")
        + "; batch-1 step "
        + ", ".join(f"{name} {ms:.2f} ms" for name, ms in steps.items())
        + f"; eager / graphs {steps['eager'] / steps['graphs']:.2f}x"
    )
    return same


MODEL_PLUGINS = {
    "LlamaForCausalLM": "llama",
    "DeepseekV3ForCausalLM": "deepseek_v4",
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "KimiLinearForCausalLM": "kimi_k3",
}
PROMPTS = [[(11 * i + 5 * j) % 300 + 3 for j in range(4 + 9 * i)] for i in range(4)]


def logits_error(llm, hf_model, device) -> float:
    """The largest |engine − transformers| prompt logit over PROMPTS, relative to the largest logit."""
    worst = 0.0
    for prompt, logits in zip(PROMPTS, llm.prompt_logits(PROMPTS)):
        reference = hf_model(torch.tensor([prompt], device=device)).logits[0].float()
        error = (logits.to(device).float() - reference).abs().max().item()
        worst = max(worst, error / max(1.0, reference.abs().max().item()))
    return worst


def check_models(device, platform: str) -> bool:
    """(b): the engine against transformers on the same device: prompt logits of the tiny Llama,
    DeepSeek-V3, DeepSeek-V4 and Kimi-Linear checkpoints (fp32), of DeepSeek-V3 in FP8 (its
    linear layers FP8 on the device, against transformers on the dense weights), and greedy
    tokens of llama58m (fp32)."""
    import tempfile
    from pathlib import Path

    import transformers

    from engine import LLM, SamplingParams
    from engine.model_loader.checkpoint import resolve_model_path
    from engine.testing.checkpoints import make_tiny_checkpoint

    results, ok = {}, True
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    settings = {"dtype": "float32", "kv_cache_memory": 0.05, "progress": False}
    for architecture, plugin in MODEL_PLUGINS.items():
        try:
            hf_model = make_tiny_checkpoint(architecture, work / architecture).to(device)
            llm = LLM(str(work / architecture), plugins=[platform, plugin], **settings)
            error = logits_error(llm, hf_model, device)
            results[architecture] = {"max_relative_logit_error": error, "ok": error <= 2e-3}
            del llm
        except Exception as failure:  # noqa: BLE001 - one model's failure is recorded, the rest still run
            results[architecture] = {"error": repr(failure)[-2000:], "ok": False}
        ok &= results[architecture]["ok"]
        print(f"{architecture:32s} vs transformers: {results[architecture]}")
    try:
        make_tiny_checkpoint("DeepseekV3ForCausalLM", work / "fp8")
        from engine_cuda.fp8 import write_fp8_checkpoint

        write_fp8_checkpoint(work / "fp8", work / "fp8_dense", (16, 16), ("proj.weight", "proj_with_mqa.weight"))
        hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(work / "fp8_dense", dtype=torch.float32).to(
            device
        )
        llm = LLM(str(work / "fp8"), plugins=[platform, "deepseek_v4", "cuda"], **settings)
        quantizer = llm.engine.setup.quantizer
        error = logits_error(llm, hf_model, device)
        kept = llm.engine.setup.dequantizer.kept
        # W8A8: the activations in e4m3 too (about 3% relative per layer on random weights)
        results["DeepseekV3 FP8"] = {
            "quantizer": quantizer.name if quantizer else None,
            "kept_fp8": kept,
            "max_relative_logit_error": error,
            "ok": error <= 0.1 and (platform == "cpu" or (quantizer is not None and kept > 0)),
        }
        del llm
    except Exception as failure:  # noqa: BLE001
        results["DeepseekV3 FP8"] = {"error": repr(failure)[-2000:], "ok": False}
    ok &= results["DeepseekV3 FP8"]["ok"]
    print(f"{'DeepseekV3 FP8':32s} vs transformers (dense): {results['DeepseekV3 FP8']}")
    try:
        path = resolve_model_path("llama58m")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        llm = LLM("llama58m", plugins=[platform, "llama"], dtype="float32", progress=False)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        theirs = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=device)
            out = hf_model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            theirs.append(out[0, len(prompt) :].tolist())
        same = [a == b for a, b in zip(ours, theirs)]
        results["llama58m greedy"] = {"identical": same, "ok": all(same)}
        del llm
    except Exception as failure:  # noqa: BLE001
        results["llama58m greedy"] = {"error": repr(failure)[-2000:], "ok": False}
    ok &= results["llama58m greedy"]["ok"]
    print(f"{'llama58m greedy':32s} vs transformers generate: {results['llama58m greedy']}")
    RESULTS["models"] = results
    return ok


def check_library_backends(device) -> bool:
    """FlashInfer's and flash-attn's backends, where those libraries are installed: llama58m's
    greedy tokens (bf16) with each against triton_paged's, recorded (bf16 rounding may flip a
    near tie, so a difference is reported, not failed)."""
    from engine import LLM, SamplingParams
    from engine_cuda.attention_libraries import FLASH_ATTN, FLASHINFER, usable

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = {}
    names = [name for library, name in ((FLASHINFER, "flashinfer"), (FLASH_ATTN, "flash_attn")) if usable(library)]
    if not names:
        print("FlashInfer / flash-attn: neither installed; skipped")
        RESULTS["library_backends"] = {}
        return True
    outputs = {}
    for name in ["triton_paged", *names]:
        llm = LLM("llama58m", plugins=["cuda", "llama"], dtype="bfloat16", progress=False, attention_backend=name)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        del llm
    for name in names:
        same = sum(a == b for a, b in zip(outputs[name], outputs["triton_paged"]))
        results[name] = {"prompts_identical_to_triton_paged": f"{same}/{len(PROMPTS)}"}
        print(f"{name}: greedy tokens identical to triton_paged for {same}/{len(PROMPTS)} prompts")
    RESULTS["library_backends"] = results
    return True


def copy_bandwidth(device) -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read plus bytes written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    _, ms = timed(lambda: dst.copy_(src), repeat=10)
    return 2 * src.numel() / (ms / 1000) / 1e9


def attention_read(device, context: int, num_seqs: int) -> tuple[float, int]:
    """(ms, KV bytes read) of one decode step of ``num_seqs`` sequences at ``context`` keys
    (bf16, GQA 32/8, head size 128, blocks of 16 scattered over the cache)."""
    from engine.kernels.paged_attention import paged_attention

    heads, kv_heads, head_size, block_size = 32, 8, 128, 16
    blocks = num_seqs * context // block_size
    k_cache = torch.randn(blocks, block_size, kv_heads, head_size, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=device).view(num_seqs, -1)
    q = torch.randn(num_seqs, heads, head_size, device=device, dtype=torch.bfloat16)
    token_seq = torch.arange(num_seqs, device=device)
    token_pos = torch.full((num_seqs,), context - 1, device=device)
    _, ms = timed(
        lambda: paged_attention(q, k_cache, v_cache, head_size, tables, token_seq, token_pos, head_size**-0.5, None),
        repeat=10,
    )
    return ms, 2 * k_cache.numel() * k_cache.element_size()


def check_attention_bandwidth(device) -> bool:
    """The decode kernel's KV read rate at 1k, 8k and 32k context, as a share of the copy
    bandwidth (the issue asks for 70% at 32k; the figure is recorded, not judged here)."""
    copy = copy_bandwidth(device)
    figures = {}
    for context, num_seqs in ((1024, 64), (8192, 16), (32768, 4)):
        ms, read = attention_read(device, context, num_seqs)
        rate = read / (ms / 1000) / 1e9
        figures[f"{context // 1024}k"] = {"seqs": num_seqs, "ms": ms, "GB/s": rate, "of_copy": rate / copy}
        print(
            f"decode attention at {context // 1024}k x {num_seqs}: {ms:.3f} ms, {rate:.0f} GB/s, {rate / copy:.0%} of copy"
        )
    RESULTS["attention_bandwidth"] = {"copy_GB/s": copy, **figures}
    return True


def run_bench(workload: str) -> bool:
    """``engine bench WORKLOAD --peers hf --json`` (the engine on the GPU; HF on the same one)."""
    command = [sys.executable, "-m", "engine", "bench", workload, "--peers", "hf", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        print(f"engine bench {workload} failed:\n{done.stderr[-3000:]}")
        RESULTS[f"bench_{workload}"] = {"error": done.stderr[-3000:]}
        return False
    RESULTS[f"bench_{workload}"] = json.loads(done.stdout)
    print(f"engine bench {workload}: recorded")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="gpu_check.json", help="Where the figures are written.")
    parser.add_argument("--no-bench", action="store_true", help="Skip the engine bench runs.")
    parser.add_argument(
        "--models-on-cpu",
        action="store_true",
        help="Run only the model checks, on the CPU platform (a rehearsal of check (b) on a machine without a GPU).",
    )
    args = parser.parse_args()
    if args.models_on_cpu:
        with torch.inference_mode():
            passed = check_models(torch.device("cpu"), "cpu")
        print("passed" if passed else "FAILED")
        return 0 if passed else 1
    if not torch.cuda.is_available():
        print(
            "no CUDA or ROCm GPU visible: this script runs the kernels natively (the test suite checks them "
            "on the CPU under TRITON_INTERPRET=1)"
        )
        return 2
    device = torch.device("cuda", 0)
    runtime = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {runtime}")
    RESULTS["device"] = {
        "name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "runtime": runtime,
    }
    started = time.perf_counter()
    checks = (
        check_paged_attention,
        check_kda,
        check_mamba2,
        check_moe,
        check_fp8_gemm,
        check_fp8_layer_ops,
        check_group_quant,
        check_attention_bandwidth,
    )
    with torch.inference_mode():
        results = [check(device) for check in checks]
    platform = "rocm" if torch.version.hip else "cuda"
    with torch.inference_mode():
        results.append(check_models(device, platform))
        if platform == "cuda":
            results.append(check_library_backends(device))
    results.append(check_decode_graphs(device))
    if not args.no_bench:
        results += [run_bench("latency"), run_bench("throughput")]
    RESULTS["passed"] = all(results)
    RESULTS["seconds"] = time.perf_counter() - started
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(RESULTS, f, indent=1)
    print(f"{'passed' if all(results) else 'FAILED'} in {RESULTS['seconds']:.0f} s; figures in {args.json}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
