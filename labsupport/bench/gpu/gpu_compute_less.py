"""``make gpu-check``, part 4: chapter 09's "compute less" on a GPU, with random weights of real shapes.

* **spec identity**: greedy output with prompt-lookup guesses and with a draft model equals plain
  decoding on a tiny random model (the verify steps run eagerly, plain decode steps replay CUDA graphs),
  and every block comes back.
* **verify cost**: what a step costs when each of B decoding sequences feeds 1 + k tokens instead of 1
  (Llama-3.1-8B shape, bf16, contexts of 512). Speculative decoding pays while this ratio stays near 1:
  a memory-bound step reads the weights once whatever the tokens; it stops paying as the batch makes
  the step compute-bound. The step is timed through the engine's own runner (``ModelRunner.execute``)
  on a batch the scheduler made, repeated without advancing the requests (idempotent: the same K/V is
  written to the same slots).
* **quantized decode**: the same decode step with int8 and int4 weights (torch's kernels) against bf16,
  at B = 1 and 16: weight-only quantization reads 2x / 4x fewer weight bytes per step.

``--device cpu --quick`` runs tiny versions of all three (``tests/test_gpu_check.py``).
"""
from __future__ import annotations

import random

import torch

from .gpu_decode import free_memory, random_llm, sync

K = 4  # guesses per verify step


def check_spec_identity(device, dtype) -> dict:
    from ...engine.request import SamplingParams

    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], list(range(40, 60))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = random_llm("random:tiny", device, torch.float32, 64)
    want = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    out = {}
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1}),
                       ("draft_model", {"method": "draft_model", "model": "random:tiny", "num_speculative_tokens": K})):
        llm = random_llm("random:tiny", device, torch.float32, 64, speculative_config=spec)
        got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        s = llm.stats()
        out[name] = {"same_tokens": got == want, "blocks_free": s["kv_blocks_free"] == s["kv_blocks_total"],
                     "acceptance_length": 1 + s["spec_decode_num_accepted_tokens"] / max(1, s["spec_decode_num_drafts"])}
        llm.shutdown()
    plain.shutdown()
    out["ok"] = all(v["same_tokens"] and v["blocks_free"] for v in out.values())
    return out


def _decoding(llm, batch: int, context: int, seed: int = 0):
    """``batch`` requests past their prompt of ``context`` tokens, ready to decode."""
    from ...engine.request import SamplingParams

    rng, vocab = random.Random(seed), llm.engine.model.config.vocab_size
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    reqs = [llm.engine.add_request([rng.randrange(vocab) for _ in range(context)], params) for _ in range(batch)]
    while any(not r.output_token_ids for r in reqs):
        llm.engine.step()
    return reqs


def _time_step(llm, device, iters: int) -> float:
    """Median seconds of the runner's forward pass on the batch the scheduler makes now; the requests are
    not advanced (no ``update_from_output``), so the same batch can be scheduled and timed again."""
    out = llm.engine.scheduler.schedule()
    runner = llm.engine.runner
    times = []
    for i in range(iters + 2):
        sync(device)
        start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            runner.execute(out)
            end.record()
            sync(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time
            t = time.perf_counter()
            runner.execute(out)
            times.append(time.perf_counter() - t)
    return sorted(times[2:])[len(times[2:]) // 2]


def check_verify_cost(device, quick: bool, dtype) -> dict:
    spec, batches, context, iters = ("random:tiny", (1, 4), 32, 3) if quick else ("random:llama-3.1-8b",
                                                                                   (1, 8, 32, 64), 512, 10)
    llm = random_llm(spec, device, dtype, max(batches) * (-(-(context + 80) // 16)) + 8, enforce_eager=True,
                  speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2,
                                      "prompt_lookup_min": 1})
    rows = {}
    for b in batches:
        reqs = _decoding(llm, b, context)
        for r in reqs:
            r.spec.propose([])
        one = _time_step(llm, device, iters)
        for r in reqs:
            r.spec.propose([1] * K)  # any tokens: the cost of verifying does not depend on them
        verify = _time_step(llm, device, iters)
        llm.engine.abort_requests(reqs)
        rows[f"B={b}"] = {"decode_ms": one * 1e3, "verify_ms": verify * 1e3, "ratio": verify / one,
                          "break_even_acceptance_length": verify / one}
    s = llm.stats()
    out = {"model": spec, "k": K, "context": context, "rows": rows, "blocks_free": s["kv_blocks_free"] == s["kv_blocks_total"]}
    llm.shutdown()
    return out


def check_quantized_decode(device, quick: bool, dtype) -> dict:
    spec, batches, context, iters = ("random:tiny", (1, 4), 32, 3) if quick else ("random:llama-3.1-8b", (1, 16), 512, 10)
    out = {"model": spec, "context": context}
    for method in (None, "int8", "int4"):
        llm = random_llm(spec, device, dtype, max(batches) * (-(-(context + 80) // 16)) + 8, enforce_eager=True,
                      quantization=method)
        row = {"paths": (llm.engine.quantization_report or {}).get("paths")}
        for b in batches:
            reqs = _decoding(llm, b, context)
            row[f"B={b}_ms"] = _time_step(llm, device, iters) * 1e3
            llm.engine.abort_requests(reqs)
        out[method or str(dtype).removeprefix("torch.")] = row
        llm.shutdown()
    return out


def check_compute_less(device, quick: bool, dtype) -> dict:
    report = {"spec_identity": check_spec_identity(device, dtype)}
    free_memory(device)
    report["verify_cost"] = check_verify_cost(device, quick, dtype)
    free_memory(device)
    report["quantized_decode"] = check_quantized_decode(device, quick, dtype)
    free_memory(device)
    report["ok"] = report["spec_identity"]["ok"] and report["verify_cost"]["blocks_free"]
    return report


def format_compute_less(r: dict) -> list[str]:
    lines = []
    for name, row in r["spec_identity"].items():
        if isinstance(row, dict):
            lines.append(f"    spec {name:11s} greedy same as plain: {row['same_tokens']}, blocks freed: "
                         f"{row['blocks_free']}, acceptance length {row['acceptance_length']:.2f}")
    v = r["verify_cost"]
    for b, row in v["rows"].items():
        lines.append(f"    verify 1+{v['k']} vs 1 token, {v['model']} ctx {v['context']}, {b}: {row['verify_ms']:.2f} vs "
                     f"{row['decode_ms']:.2f} ms = x{row['ratio']:.2f} (pays above that acceptance length)")
    q = r["quantized_decode"]
    for method, row in ((m, x) for m, x in q.items() if isinstance(x, dict)):
        times = ", ".join(f"{k.removesuffix('_ms')} {t:.2f} ms" for k, t in row.items() if k.endswith("_ms"))
        lines.append(f"    decode {method:9s} {q['model']}: {times}")
    return lines
