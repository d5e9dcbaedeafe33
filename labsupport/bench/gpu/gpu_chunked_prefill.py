"""``make gpu-check``, part 5: chapter 05's chunked prefill on a GPU, with random weights of a real shape.

On the 2-core CPU chapter 05 measures what chunking costs as well as what it buys: the decoders' worst
gaps shrink, but their typical gap grows (every step that carries a chunk is slower, because a CPU step's
time grows with its tokens). On a GPU a decode step of a few sequences is memory-bound: it reads every
weight whatever its tokens, so a chunk of a few hundred prompt tokens rides along nearly free until the
step turns compute-bound (Sarathi-Serve, Agrawal et al., OSDI 2024). This part runs the chapter's own
workload at its GPU scale (``GPU_SCALE = 4``: 16 decoders of 48 tokens, two 4,096-token prompts arriving
among them, chunks of 256-2,048 tokens) on a Llama-3.1-8B-shaped model in bf16, through the real
engine, unchunked and over the sweep, and reports the decoders' ITL (P50, P99, max), the long prompts'
TTFT, and the median time of a decode-only step beside a step that also carries a chunk.

Random bf16 weights: a greedy token may flip between two batch shapes at a near-tie, so the share of
tokens equal to the unchunked run's is reported, not asserted (the CPU's chapter asserts equality).
``--quick`` runs a tiny version of it on any device (``tests/test_gpu_check.py``).
"""
from __future__ import annotations

import statistics

from .gpu_decode import random_llm
from ..offline.workload import long_prompt_workload


def _run(llm, workload, chunked: bool, budget: int) -> dict:
    from ..offline.driver import run_workload
    from ..summary import summarize

    steps = []  # (seconds, prompt tokens in the step, sequences)

    def on_step(engine):
        out = engine.last_step
        prompt = sum(n for n, p in zip(out.num_new_tokens, out.is_prefill) if p)
        steps.append((out.end - out.start, prompt, len(out.requests)))

    with llm.engine.options(enable_chunked_prefill=chunked, max_num_batched_tokens=budget):
        outputs, seconds = run_workload(llm, workload, on_step=on_step, clock="steps", use_tqdm=False)
    short = [o for o in outputs if o.request_id.startswith("short")]
    long_ = [o for o in outputs if o.request_id.startswith("long")]
    s, l = summarize(short, seconds), summarize(long_, seconds)
    decode_only = [t for t, prompt, _ in steps if prompt == 0]
    mixed = [(t, prompt) for t, prompt, n in steps if prompt and n > 1]
    return {"tokens": [o.token_ids for o in outputs], "steps": len(steps),
            "itl_p50_ms": s["p50_itl_ms"], "itl_p99_ms": s["p99_itl_ms"],
            "itl_max_ms": 1e3 * max(g for o in short for g in o.metrics.itl),
            "tpot_p99_ms": s["p99_tpot_ms"], "long_ttft_p50_ms": l["p50_ttft_ms"],
            "decode_step_ms": 1e3 * statistics.median(decode_only) if decode_only else None,
            "mixed_step_ms": 1e3 * statistics.median(t for t, _ in mixed) if mixed else None,
            "mixed_step_prompt_tokens": statistics.median(p for _, p in mixed) if mixed else None,
            "step_p50_ms": 1e3 * statistics.median(t for t, _, _ in steps),
            "step_max_ms": 1e3 * max(t for t, _, _ in steps)}


def check_chunked_prefill(device, quick: bool, dtype, spec: str | None = None) -> dict:
    """Chapter 05's workload on ``spec`` (default: the Llama-3.1-8B shape; ``gpu_preflight`` also runs the
    chapter's own default model's shape)."""
    if quick:
        spec, num_decoding, decode_tokens, long_tokens, chunks = spec or "random:tiny", 2, 8, 64, (16, 32)
    else:  # chapter 05's parameters x its GPU_SCALE of 4
        spec, num_decoding, decode_tokens, long_tokens = spec or "random:llama-3.1-8b", 16, 48, 4096
        chunks = (256, 512, 1024, 2048)
    num_blocks = (num_decoding * -(-(32 + decode_tokens + 1) // 16) + 2 * -(-(long_tokens + 9) // 16)) * 2 + 16
    llm = random_llm(spec, device, dtype, num_blocks)
    # the chapter's own workload; a random model's tokenizer turns its text into bytes
    workload = long_prompt_workload(llm.tokenizer, num_decoding=num_decoding, decode_input_len=32,
                                    decode_output_len=decode_tokens, num_long=2, long_input_len=long_tokens,
                                    long_output_len=8, long_start=4, long_every=16)
    _run(llm, workload, chunked=False, budget=2 * long_tokens)  # warm-up: kernels compiled, CUDA graphs captured
    whole = _run(llm, workload, chunked=False, budget=2 * long_tokens)
    runs = {"whole": whole} | {f"chunk {c}": _run(llm, workload, chunked=True, budget=c) for c in chunks}
    want = whole["tokens"]
    for r in runs.values():
        got = r.pop("tokens")
        r["same_tokens_as_whole"] = sum(a == b for x, y in zip(want, got) for a, b in zip(x, y)) / sum(map(len, want))
    s = llm.stats()
    out = {"model": spec, "decoders": num_decoding, "decode_tokens": decode_tokens, "long_prompt_tokens": long_tokens,
           "runs": runs, "blocks_free": s["kv_blocks_free"] == s["kv_blocks_total"]}
    llm.shutdown()
    return out


def format_chunked_prefill(r: dict) -> list[str]:
    lines = [f"    {r['model']}: {r['decoders']} decoders x {r['decode_tokens']} tokens, 2 prompts of "
             f"{r['long_prompt_tokens']:,} tokens arriving; blocks freed {r['blocks_free']}"]
    for name, x in r["runs"].items():
        steps = (f"; step: decode {x['decode_step_ms']:.1f} ms" if x["decode_step_ms"] is not None else "") + (
            f", with a {x['mixed_step_prompt_tokens']:.0f}-token chunk {x['mixed_step_ms']:.1f} ms"
            if x["mixed_step_ms"] is not None else "")
        lines.append(f"    {name:10s} ITL P50 {x['itl_p50_ms']:6.1f} P99 {x['itl_p99_ms']:6.1f} max {x['itl_max_ms']:6.1f} ms"
                     f" | long TTFT P50 {x['long_ttft_p50_ms']:7.1f} ms | {x['steps']} steps{steps}"
                     f" | same tokens {x['same_tokens_as_whole']:.0%}")
    return lines
