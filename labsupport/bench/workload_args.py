"""The flat ``bench``'s workload, scheduling and KV flags, and the workload they describe: declared once, for
``python -m labsupport bench`` (a real run) and ``bench simulate`` (the same run on a simulated clock)."""
from __future__ import annotations

import argparse


def add_workload_arguments(bench: argparse.ArgumentParser):
    """The flat ``bench``'s workload and scheduling flags, shared with ``bench simulate`` (same names, same runs)."""
    bench.add_argument("--workload", default="poisson", choices=["poisson", "long-prompts"],
                       help="poisson: seeded Poisson arrivals; long-prompts: --num-requests short requests decoding, "
                            "--num-long long prompts arriving among them (chapter 05)")
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--rate", type=float, default=float("inf"),
                       help="Poisson arrivals per second (inf: all at once)")
    bench.add_argument("--input-len", type=int, nargs="+", default=[128], help="prompt lengths to draw from")
    bench.add_argument("--output-len", type=int, nargs="+", default=[64], help="output lengths to draw from")
    bench.add_argument("--shared-prefix-len", type=int, default=0)
    bench.add_argument("--num-long", type=int, default=2, help="long-prompts: how many long prompts")
    bench.add_argument("--long-input-len", type=int, default=1024, help="long-prompts: their length in tokens")
    bench.add_argument("--long-start", type=float, default=4, help="long-prompts: arrival of the first (clock units)")
    bench.add_argument("--long-every", type=float, default=16, help="long-prompts: gap between them (clock units)")
    bench.add_argument("--clock", default=None, choices=["wall", "steps"],
                       help="arrival times in seconds or in engine steps (default: wall for poisson, steps for "
                            "long-prompts)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--scheduling-policy", default="continuous", choices=["continuous", "fcfs", "static"])
    bench.add_argument("--enable-chunked-prefill", action="store_true")
    bench.add_argument("--long-prefill-token-threshold", type=int, default=0)
    bench.add_argument("--max-num-batched-tokens", type=int, default=8192)


def workload_from_args(tokenizer, args):
    """The workload ``add_workload_arguments``' flags describe, and the clock its arrivals are read on."""
    from .offline.workload import long_prompt_workload, poisson_workload
    if args.workload == "poisson":
        workload = poisson_workload(tokenizer, args.num_requests, args.rate, args.input_len, args.output_len,
                                    args.shared_prefix_len, args.seed)
    else:
        workload = long_prompt_workload(tokenizer, args.num_requests, args.input_len[0], args.output_len[0],
                                        args.num_long, args.long_input_len, 8, args.long_start, args.long_every,
                                        args.seed)
    return workload, args.clock or ("wall" if args.workload == "poisson" else "steps")


def add_kv_arguments(p: argparse.ArgumentParser):
    """The KV pool and batch flags every engine command takes (``generate``, ``serve``, ``bench``, ``simulate``)."""
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--cpu-offload-blocks", type=int, default=0, help="CPU tier size in blocks (prefix caching)")
