"""Command line: ``python -m labsupport {generate,chat,serve,router,prepare,bench}``.

``bench compare|roofline|profile|serve|course-table|spec|roofline-lab|quant`` are handed to ``labsupport.bench.cli`` before this parser
runs; plain ``bench --workload ...`` is parsed here, as in chapters 04-05.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``generate``, ``chat``, ``serve``, ``prepare`` and the flat ``bench``."""
    parser = argparse.ArgumentParser(prog="python -m labsupport", description="LLM Serving Lab engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print the completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the chat template to the prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    from .chat_cli import add_arguments as add_chat_arguments
    add_chat_arguments(sub.add_parser("chat", help="chat with the model (in-process, or --url a server)"))
    srv = sub.add_parser("serve", help="start the OpenAI-compatible server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None)
    from .serve.server import add_serve_arguments
    add_serve_arguments(srv)
    sub.add_parser("prepare", help="convert the embedded default model once (make lab does this)")
    bench = sub.add_parser("bench", help="run a synthetic workload through the engine and print serving metrics",
                           epilog="subcommands: bench compare | roofline | profile | serve | course-table | spec | roofline-lab | quant "
                                  "| simulate "
                                  "(each with --help): ours vs transformers vs vLLM, the machine's roofline, our engine "
                                  "under the profiler, a load generator for any OpenAI-compatible server, what each "
                                  "chapter bought, speculative decoding, the engine's steps on the roofline, weight "
                                  "quantization judged on a task set; bench soak: a server and a PD router under "
                                  "abuse, against issue 41's targets")
    from .bench.workload_args import add_kv_arguments, add_workload_arguments
    add_workload_arguments(bench)  # shared with bench simulate
    bench.add_argument("--json", action="store_true", help="print the summary as JSON")
    for p in (gen, srv, bench):
        p.add_argument("--model", default=None, help="HF folder or hub id (default: embedded SmolLM2-135M-Instruct)")
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--kv-cache", default="paged", choices=["paged", "contiguous", "none"])
        add_kv_arguments(p)
        p.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="share of the GPU's total memory for weights + KV cache (default 0.2: several engines fit)")
    srv.add_argument("--enable-result-cache", action="store_true")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["router"]:  # chapter 07: needs no model, has its own flags
        from .pd.router_app import main as router_main
        return router_main(argv[1:])
    from .bench.cli import SUBCOMMANDS
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in SUBCOMMANDS:
        from .bench.cli import main as bench_main
        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)

    if args.command == "chat":
        from .chat_cli import main as chat_main
        return chat_main(args)
    if args.command == "prepare":
        from .models.loader import prepare_default_model
        print(prepare_default_model())
        import torch
        if not torch.cuda.is_available():  # build the CPU kernels now, not in a chapter's first cell
            from .kernels import cpu_attention, cpu_ops
            print("building the CPU kernels (once per machine, about a minute) ...", flush=True)
            built, why_not = cpu_attention.available()
            print("CPU attention kernels: built" if built else f"{why_not}; engines will keep the PyTorch gather")
            built, why_not = cpu_ops.build()
            print("CPU model kernels: built" if built else f"{why_not}; the model keeps PyTorch's code")
            from .kernels import cpu_decode_layers
            built, why_not = cpu_decode_layers.available()
            print("CPU decode layer: built" if built else f"{why_not}; decode steps keep the Python layers")
        return 0
    from . import LLM, SamplingParams
    try:
        options = dict(kv_cache=args.kv_cache, block_size=args.block_size, num_blocks=args.num_blocks,
                       max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                       enable_prefix_caching=args.enable_prefix_caching, cpu_offload_blocks=args.cpu_offload_blocks)
        if args.gpu_memory_utilization is not None:
            options["gpu_memory_utilization"] = args.gpu_memory_utilization
        if args.command == "serve":
            from .serve.server import engine_options
            options.update(engine_options(args))
        if args.command == "bench":
            options.update(scheduling_policy=args.scheduling_policy, enable_chunked_prefill=args.enable_chunked_prefill,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           long_prefill_token_threshold=args.long_prefill_token_threshold)
        if args.command == "serve" and not args.engine_in_process:  # the engine core in its own process
            from .serve.core_client import EngineCoreStartError
            from .serve.server import run_server, start_engine_core
            try:
                core = start_engine_core(dict(model=args.model, device=args.device, dtype=args.dtype, **options), args)
            except EngineCoreStartError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2 if exc.bad_option else 1
            return run_server(core, args)
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype,
                  enable_result_cache=getattr(args, "enable_result_cache", False), **options)
        if args.command == "generate":
            prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
            out = llm.generate(prompt, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                      seed=args.seed), use_tqdm=False)[0]
            print(out.text)
            from .chat_cli import chat_hint
            if hint := chat_hint(llm, prompt):
                print(hint, file=sys.stderr)
            return 0
        if args.command == "bench":
            return run_bench(llm, args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .serve.server import run_server
    return run_server(llm, args)


def run_bench(llm, args) -> int:
    import json

    from .bench import run_workload, summarize
    from .bench.workload_args import workload_from_args
    from .bench.summary import format_summary

    workload, clock = workload_from_args(llm.tokenizer, args)
    outputs, duration = run_workload(llm, workload, clock=clock)
    groups = {"all": outputs}
    if args.workload == "long-prompts":  # the decoders' ITL and the long prompts' TTFT are the story
        groups = {name: [o for o in outputs if o.request_id.startswith(name)] for name in ("short", "long")}
    summaries = {name: summarize(outs, duration) for name, outs in groups.items()}
    if args.json:
        print(json.dumps(summaries["all"] if len(summaries) == 1 else summaries, indent=2))
    else:
        for name, summary in summaries.items():
            if len(summaries) > 1:
                print(f"--- {name} requests")
            print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
