"""``make gpu-check``, parts 1-3: the decode path on a GPU, with random weights of real shapes.

1. **kernel**: the Triton paged-attention decode kernel (``kernels/triton_attention.py``) against the
   PyTorch path (``paged_decode_attention``): agreement in fp32 and bf16, and both timed at batch 64.
2. **decode**: one decode step of the real engine pieces at batch 64, contexts 512-1024, as achieved
   memory bandwidth and as a fraction of the device's measured copy bandwidth (the target is 70 %),
   eager and through the engine's CUDA-graph decode.
3. **w1**: bench compare's W1 shape through the real ``LLM`` on random SmolLM2-shaped weights.

``gpu_check.py`` runs these with the other parts and prints the report; ``random_decode_case`` also
serves the CPU kernels' tests.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import random
import time
import traceback
from types import SimpleNamespace

import torch

HEAD_SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}  # query heads, KV heads, head_dim
BLOCK_SIZE = 16
TARGET = 0.70  # of the measured copy bandwidth
DECODE_MODELS = ("llama-3.1-8b", "qwen3-8b", "smollm2-135m")


def random_decode_case(lens, heads, kv_heads, head_dim, block_size, dtype, device="cpu", seed=0):
    """q, K/V pools and ``DecodeRows`` for decode rows of context ``lens``: random values in every slot
    (block 0 too, so an unmasked padding slot shows) and shuffled, non-contiguous block tables padded
    with block 0, as ``PagedAttention.prepare`` builds them."""
    from ...engine.attention_metadata import DecodeRows

    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    width, tables = max(per_seq), []
    for n in per_seq:
        tables.append(order[:n] + [0] * (width - n))
        order = order[n:]
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    shape = (kv_heads, num_blocks * block_size, head_dim)
    k_pool, v_pool = (torch.randn(shape, generator=dev_gen, device=device).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), heads, head_dim, generator=dev_gen, device=device).to(dtype)
    context_lens = torch.tensor(lens)
    rows = DecodeRows(token_index=torch.arange(len(lens), device=device),
                      block_tables=torch.tensor(tables, device=device), context_lens=context_lens.to(device),
                      padding=(torch.arange(width * block_size)[None, :] >= context_lens[:, None]).to(device))
    return q, k_pool, v_pool, rows


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timeit(fn, device, iters: int, rounds: int = 3, warmup: int = 2) -> float:
    """Seconds per call: the best round's mean (a ceiling of speed, like a roofline's)."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(rounds):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting what is read and what is written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(7)  # touched: no zero-page reads
    dst = torch.empty_like(src).fill_(0)
    seconds = timeit(lambda: dst.copy_(src), device, iters=10)
    return 2 * nbytes / seconds


def decode_paths(device) -> dict:
    """The decode paths that can run here: always PyTorch's; the kernel on CUDA or under the interpreter."""
    from ...kernels import triton_attention
    from ...engine.paged_attention import paged_decode_attention

    paths = {"torch": paged_decode_attention}
    if triton_attention.available(device):
        paths["triton"] = triton_attention.triton_decode_attention
    return paths


# ------------------------------------------------------------------ 1. the kernel

def check_kernel(device, quick: bool) -> dict:
    from ...engine.paged_attention import PagedAttention, paged_decode_attention

    paths = decode_paths(device)
    if "triton" not in paths:
        return {"skipped": "triton is not installed (pip install triton), or no CUDA and TRITON_INTERPRET unset"}
    kernel = paths["triton"]
    engine_path = PagedAttention(1, 1, BLOCK_SIZE, 1, 16, torch.float32, device).decode_attention.__name__
    out = {"engine_default_decode_path": engine_path, "agreement": {}, "timing": {}, "ok": True}
    lens = [1, 15, 16, 17, 40] if quick else [1, 15, 16, 17, 100, 1000, 2049]
    for name, (h, hkv, d) in HEAD_SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, rows = random_decode_case(lens, h, hkv, d, BLOCK_SIZE, dtype, device)
            got = kernel(q, k, v, rows, BLOCK_SIZE).float()
            ref = paged_decode_attention(q, k, v, rows, BLOCK_SIZE).float()
            row = {"max_abs_error": (got - ref).abs().max().item()}
            if dtype == torch.float32:
                row["ok"] = row["max_abs_error"] < 1e-4
            else:  # both paths round differently: judge each against fp32 arithmetic on the same inputs
                exact = paged_decode_attention(q.float(), k.float(), v.float(), rows, BLOCK_SIZE)
                row["kernel_vs_fp32"] = (got - exact).abs().max().item()
                row["torch_vs_fp32"] = (ref - exact).abs().max().item()
                row["ok"] = row["kernel_vs_fp32"] <= max(1.5 * row["torch_vs_fp32"], 1e-2)
            out["agreement"][f"{name} {str(dtype).removeprefix('torch.')}"] = row
            out["ok"] &= row["ok"]
    batch, context = (4, 64) if quick else (64, 1024)
    for name, (h, hkv, d) in HEAD_SHAPES.items():
        q, k, v, rows = random_decode_case([context] * batch, h, hkv, d, BLOCK_SIZE, torch.bfloat16, device)
        kv_bytes = 2 * batch * context * hkv * d * k.element_size()
        row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
        for path, fn in paths.items():
            seconds = timeit(lambda: fn(q, k, v, rows, BLOCK_SIZE), device, iters=1 if quick else 20,
                             rounds=1 if quick else 3)
            row[f"{path}_ms"], row[f"{path}_kv_gb_s"] = seconds * 1e3, kv_bytes / seconds / 1e9
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        out["timing"][name] = row
    return out


# ------------------------------------------------------------------ 2. one decode step of the engine

def check_decode(device, quick: bool, dtype, copy_bw: float) -> dict:
    from ...models.loader import RANDOM_MODELS

    batch, (lo, hi) = (4, (24, 40)) if quick else (64, (512, 1024))
    lens = [lo + (hi - lo) * i // max(batch - 1, 1) for i in range(batch)]
    out = {"batch": batch, "context_min_max": [lo, hi], "mean_context": sum(lens) / batch}
    for name in DECODE_MODELS:
        cfg = RANDOM_MODELS[name]
        if quick:  # the head shapes stay; the rest shrinks to what a CPU runs in a second
            cfg = dataclasses.replace(cfg, num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=1024)
        out[name] = time_decode_step(cfg, lens, device, dtype, copy_bw, quick)
        free_memory(device)
    return out


def time_decode_step(cfg, lens, device, dtype, copy_bw: float, quick: bool) -> dict:
    """One decode step of ``len(lens)`` sequences through ``ModelRunner.execute``, with each decode path."""
    from ...kernels.cuda_graphs import DecodeGraphs
    from ...engine.paged_attention import PagedAttention
    from ...engine.runner import ModelRunner
    from ...engine.scheduler import SchedulerOutput
    from ...kernels.select import select
    from ...models.loader import random_model

    model = random_model(cfg, device, dtype)
    model.use_kernels(select(device, dtype))  # the engine's kernels for this device, as LLMEngine gives them
    embedding = model.model.embed_tokens.weight  # read only at B rows, unless it is also the LM head
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                       if p is not embedding or cfg.tie_word_embeddings)
    kv_bytes = sum(lens) * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    num_blocks = sum(-(-(n + 1) // BLOCK_SIZE) for n in lens) + 1
    backend = PagedAttention(cfg.num_layers, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim, dtype, device,
                             scratch_block=True)
    blocks = iter(random.Random(0).sample(range(1, num_blocks), num_blocks - 1))  # scattered, as in a busy pool
    requests = [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=n - 1, num_tokens=n, all_token_ids=[i % 100] * n,
                                block_table=[next(blocks) for _ in range(-(-n // BLOCK_SIZE))],
                                params=SimpleNamespace(greedy=True)) for i, n in enumerate(lens)]
    step = SchedulerOutput(requests=requests, num_new_tokens=[1] * len(lens))
    runner = ModelRunner(model, backend, device)
    row = {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes}
    moved = weight_bytes + kv_bytes
    for path, fn in decode_paths(device).items():
        backend.decode_attention = fn
        eager = timeit(lambda: runner.execute(step), device, iters=2 if quick else 10, rounds=1 if quick else 3)
        row[path] = {"step_ms": eager * 1e3, "gb_s": moved / eager / 1e9, "of_copy": moved / eager / copy_bw}
        if device.type == "cuda" and path == "triton":  # the engine's GPU decode: static buffers + graph replay
            try:
                graphs = DecodeGraphs(model, backend, len(lens), max(lens) + BLOCK_SIZE)
                graph = timeit(lambda: runner.sampler.sample(graphs.run(step), requests), device, iters=20)
                row[path] |= {"graph_ms": graph * 1e3, "graph_gb_s": moved / graph / 1e9,
                              "graph_of_copy": moved / graph / copy_bw}
                del graphs
            except Exception as exc:  # a measurement that cannot be made is reported, not fatal
                traceback.print_exc()
                row[path]["graph_error"] = f"{type(exc).__name__}: {exc}"
    return row


def free_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_llm(spec: str, device, dtype, num_blocks: int, **options):
    """An ``LLM`` on a ``random:`` model of a real shape (no files), with a KV pool of ``num_blocks``."""
    from ... import LLM
    return LLM(model=spec, device=str(device), dtype=str(dtype).removeprefix("torch."), num_blocks=num_blocks,
               block_size=BLOCK_SIZE, **options)


# ------------------------------------------------------------------ 3. W1 through the engine

def check_w1(device, quick: bool, dtype) -> dict:
    from ..offline.driver import run_workload
    from ..summary import summarize
    from ..offline.workload import BenchRequest

    spec, (n, n_in, n_out) = ("random:tiny", (4, 32, 8)) if quick else ("random:smollm2-135m", (32, 200, 128))
    num_blocks = n * -(-(n_in + n_out + 1) // BLOCK_SIZE) + 16
    llm = random_llm(spec, device, dtype, num_blocks)
    rng = random.Random(0)
    vocab = llm.engine.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n_in)] for _ in range(n)]
    out = {"model": spec, "requests": n, "prompt_tokens": n_in, "max_tokens": n_out,
           "engine_default_decode_path": llm.engine.backend.decode_attention.__name__}
    from ...engine.runner import EagerStep
    from ...kernels.cuda_graphs import DecodeGraphs
    runner = llm.engine.runner
    graphs = runner.executor if isinstance(runner.executor, DecodeGraphs) else None
    tokens, kernels, eager = {}, decode_paths(device), EagerStep(runner.model, runner.backend)
    paths = [("triton+graphs", kernels["triton"], graphs)] if graphs is not None else []
    paths += [("triton", kernels["triton"], None)] if "triton" in kernels else []
    paths.append(("torch", kernels["torch"], None))
    for path, fn, use_graphs in paths:
        llm.engine.backend.decode_attention, runner.executor = fn, use_graphs or eager
        # warm-up at the full batch: kernels compiled, and the batch's CUDA graph captured (vLLM captures at start)
        run_workload(llm, [BenchRequest(0.0, p[:16], 4) for p in prompts], use_tqdm=False)
        outputs, wall = run_workload(llm, [BenchRequest(0.0, p, n_out) for p in prompts], use_tqdm=False)
        s = summarize(outputs, wall)
        assert s["total_output_tokens"] == n * n_out, "ignore_eos: every request makes max_tokens"
        out[path] = {"wall_s": wall, "output_tok_s": s["output_throughput"], "p50_tpot_ms": s["p50_tpot_ms"],
                     "p50_ttft_ms": s["p50_ttft_ms"]}
        tokens[path] = [o.token_ids for o in outputs]
    for path in tokens:  # random bf16 weights: near-ties may flip a greedy token now and then
        if path != "torch":
            same = sum(a == b for x, y in zip(tokens["torch"], tokens[path]) for a, b in zip(x, y))
            out[f"same_tokens_{path}_vs_torch"] = same / (n * n_out)
    out["blocks_free"] = llm.engine.kv.allocator.num_free == llm.engine.kv.num_blocks
    del llm
    free_memory(device)
    return out
