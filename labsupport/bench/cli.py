"""``python -m labsupport bench {compare,roofline,profile,serve,course-table,spec,roofline-lab,quant,capstone,
structured,serve-compare,serve-profile,soak,simulate}``: the measuring subcommands (spec to capstone are chapter
09's; structured, chapter 06's; serve-compare and serve-profile, the served path against vLLM; soak, the served path
under abuse; simulate, the engine on a simulated clock, ``sim/``).

``python -m labsupport bench --workload ...`` (flat flags, chapters 04-05) stays as it was:
``__main__`` sends argv here only when the word after ``bench`` is one of ``SUBCOMMANDS``, so
the old parser never sees a subcommand and these never see the old flags.
"""
from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = ("compare", "roofline", "profile", "serve", "course-table", "spec", "roofline-lab", "quant", "capstone",
               "serve-compare", "serve-profile", "structured", "soak", "simulate")
OWN_PARSERS = {"roofline-lab": "lab.roofline_lab", "quant": "lab.quant",  # chapter 09's: they parse their own flags
               "structured": "serving.structured_bench"}  # chapter 06's: what a structured-output grammar costs a step


def build_parser() -> argparse.ArgumentParser:
    from .offline import compare, profiling

    parser = argparse.ArgumentParser(prog="python -m labsupport bench",
                                     description="compare engines, measure the roofline, profile our engine")
    sub = parser.add_subparsers(dest="subcommand", required=True)
    cmp = sub.add_parser("compare", help="ours vs transformers vs vLLM on identical token ids (+ roofline)")
    compare.add_arguments(cmp)
    roof = sub.add_parser("roofline", help="measure memory bandwidth and matmul rates; decode-step floors")
    roof.add_argument("--quick", action="store_true", help="shorter timing rounds, bf16 at M=1 only")
    roof.add_argument("--json", metavar="FILE", default=None)
    prof = sub.add_parser("profile", help="our engine under torch.profiler: top ops, trace, step breakdown")
    profiling.add_arguments(prof)
    prof.add_argument("--json", metavar="FILE", default=None, help="write the step breakdown")
    for p in (cmp, roof, prof):
        p.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    from .serving import serve_cli  # its own --model: the served name, not a folder
    serve_cli.add_arguments(sub.add_parser("serve", help="load-test any OpenAI-compatible server over HTTP "
                                                         "(ours or vllm serve), like vllm bench serve"))
    from ..experiments import course_table  # the CLI is the one bench module that reaches up: it names them all
    course_table.add_arguments(sub.add_parser("course-table", help="every chapter's server on one workload, one "
                                                                    "client, one price: what each chapter bought"))
    from .lab import spec_bench
    spec_bench.add_arguments(sub.add_parser("spec", help="speculative decoding: acceptance and speed-up against k, "
                                                         "temperature, traffic and batch size"))
    from ..experiments import capstone
    capstone.add_arguments(sub.add_parser("capstone", help="the course engine with every technique, each one off, "
                                                           "transformers serve and vLLM on five traffics: a decision"))
    from .serving import serve_compare
    serve_compare.add_arguments(sub.add_parser("serve-compare", help="our server and vllm serve, one after the other, "
                                                                     "under vllm bench serve, guidellm and the openai SDK"))
    from .serving import serve_profile
    serve_profile.add_arguments(sub.add_parser("serve-profile", help="where our server's time goes at 64 streams "
                                                                     "(py-spy over every thread, thread vs process)"))
    from .serving import soak
    from ..sim import cli as sim_cli  # takes the flat bench's flags (workload_args.py)
    sim_cli.add_arguments(sub.add_parser("simulate", help="the real scheduler on a simulated clock: bench's workloads "
                                                          "at GPU scale in seconds, labelled with their profile"))
    soak.add_arguments(sub.add_parser("soak", help="a server and a 1P+1D router under schema fuzzing, hang-ups, "
                                                   "unread streams, a 4 MB /tokenize and a frozen worker, against "
                                                   "issue 41's targets (a few minutes)"))
    return parser


def main(argv: list[str]) -> int:
    if argv and argv[0] in OWN_PARSERS:
        import importlib
        return importlib.import_module(f".{OWN_PARSERS[argv[0]]}", __package__).main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    from .lab.roofline import warn_if_busy
    try:
        if args.subcommand == "course-table":  # records the busy check in its JSON
            from ..experiments.course_table import main as table_main
            return table_main(args)
        if args.subcommand == "capstone":  # records the busy check (at its start) in its JSON
            from ..experiments.capstone import main as capstone_main
            return capstone_main(args)
        if args.subcommand == "serve-profile":
            warn_if_busy()
            from .serving.serve_profile import main as serve_profile_main
            return serve_profile_main(args)
        if args.subcommand == "serve-compare":
            warn_if_busy()
            from .serving.serve_compare import main as serve_compare_main
            return serve_compare_main(args)
        if args.subcommand == "soak":  # pass/fail figures, not timings: no busy check
            from .serving.soak import main as soak_main
            return soak_main(args)
        if args.subcommand == "simulate":  # virtual time: no busy check (its --validate reports its own errors)
            from ..sim.cli import main as simulate_main
            return simulate_main(args)
        if args.subcommand == "serve":  # the server under test shares the machine: no busy check
            from .serving.serve_cli import main as serve_main
            return serve_main(args)
        if args.subcommand != "compare":  # compare checks, and records it in its JSON
            warn_if_busy()
        if args.subcommand == "spec":
            from .lab.spec_bench import main as spec_main
            return spec_main(args)
        if args.subcommand == "compare":
            from .offline.compare import main as compare_main
            return compare_main(args, ["bench", *argv])
        if args.subcommand == "profile":
            from .offline.profiling import main as profile_main
            return profile_main(args)
        from ..models.loader import resolve_model_path
        from .lab.roofline import format_roofline, measure
        from .summary import write_report
        roof = measure(resolve_model_path(args.model), quick=args.quick)
        print(format_roofline(roof))
        if args.json:
            write_report(args.json, roof)
        return 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
