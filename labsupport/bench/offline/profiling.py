"""``bench profile``: where does our engine's time go? ``torch.profiler`` over one workload.

The workload (W1-like: equal prompts, all at once, greedy, ``ignore_eos``; smaller by default)
runs twice after a small warm-up. The first run, unprofiled, gives honest step times: the engine
records every step's start and end (``engine.last_step``), so we read the total prefill time
and the median decode step by batch size, which is the number to hold against the roofline's
floor for that batch. The second run is under the profiler: the top operators by self CPU
time say whether the matmuls dominate (good: the floor is near) or the Python around them does,
and ``--trace`` writes a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).
"""
from __future__ import annotations

import statistics
from collections import defaultdict


def add_arguments(p):
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens, 8 out (tests)")
    p.add_argument("--trace", metavar="FILE.json", default=None, help="write a Chrome trace of the profiled run")
    p.add_argument("--row-limit", type=int, default=20, help="rows of the operator table")
    p.add_argument("--sort-by", default="self_cpu_time_total", help="key_averages().table sort key")
    p.add_argument("--seed", type=int, default=0)


def step_breakdown(steps) -> dict:
    """Total prefill time and decode step times by batch size, from ``(batch, has_prefill, seconds)``."""
    decode = defaultdict(list)
    prefill_s, prefill_steps = 0.0, 0
    for batch, has_prefill, seconds in steps:
        if has_prefill:
            prefill_s, prefill_steps = prefill_s + seconds, prefill_steps + 1
        else:
            decode[batch].append(seconds)
    return {"prefill_s": prefill_s, "prefill_steps": prefill_steps, "steps": len(steps),
            "decode_steps": {b: {"count": len(v), "median_ms": statistics.median(v) * 1e3}
                             for b, v in sorted(decode.items(), reverse=True)}}


def format_breakdown(b: dict) -> str:
    lines = [f"{b['steps']} steps; prefill: {b['prefill_s'] * 1e3:.1f} ms in {b['prefill_steps']} step(s)",
             f"{'batch':>6}{'decode steps':>14}{'median ms':>11}{'tok/s':>9}"]
    for batch, d in b["decode_steps"].items():
        lines.append(f"{batch:>6}{d['count']:>14}{d['median_ms']:>11.2f}{batch / d['median_ms'] * 1e3:>9.0f}")
    return "\n".join(lines)


def main(args) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ... import LLM
    from .driver import run_workload
    from .workload import BenchRequest, poisson_workload, warmup_prompts

    n, n_in, n_out = (4, 32, 8) if args.quick else (args.num_prompts, args.input_len, args.output_len)
    llm = LLM(model=args.model, device="cpu", dtype="float32")
    work = poisson_workload(llm.tokenizer, n, input_lens=(n_in,), output_lens=(n_out,), seed=args.seed)
    run_workload(llm, [BenchRequest(0.0, p, 4) for p in warmup_prompts(llm.tokenizer)], use_tqdm=False)
    steps = []

    def record(engine):
        s = engine.last_step
        steps.append((len(s.requests), any(s.is_prefill), s.end - s.start))

    _, wall = run_workload(llm, work, on_step=record, use_tqdm=False)
    breakdown = step_breakdown(steps)
    print(f"{n} prompts x {n_in} tokens, {n_out} out each: {n * n_out / wall:.1f} output tok/s, "
          f"{wall:.2f} s (unprofiled run)")
    print(format_breakdown(breakdown))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, profiled_wall = run_workload(llm, work, use_tqdm=False)
    print(f"\nprofiled run: {profiled_wall:.2f} s (the profiler's own overhead included); top operators:")
    print(prof.key_averages().table(sort_by=args.sort_by, row_limit=args.row_limit))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev)")
    if args.json:
        from ..summary import write_report
        write_report(args.json, {"prompts": n, "input_len": n_in, "output_len": n_out, "wall_s": wall,
                                 "threads": torch.get_num_threads(), **breakdown})
    return 0
