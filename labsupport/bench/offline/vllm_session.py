"""Runs INSIDE the vLLM virtual environment: ``python vllm_session.py``, for ``side_by_side.session``.

One process that imports vLLM once and then serves requests, one JSON line each on stdin:

* ``{"greedy": SPEC}``: vLLM's offline ``LLM``, greedy, on token ids (``vllm_worker.greedy_tokens``, the
  spec of ``side_by_side/offline.py``); the engine is dropped afterwards, its KV cache freed.
* ``{"vllm": [ARG, ...]}``: the ``vllm`` command's own ``main()`` with these arguments, as if typed after
  ``vllm`` (``["bench", "serve", "--base-url", ...]``): the same parser, the same code, no new process.
* ``{"parse_serve": [LINE, ...]}``: what ``vllm serve``'s own parser makes of each command line of a
  recipe (``disagg.check_recipe``).

Why a process that stays: every ``vllm`` command, and every script that imports vLLM, spends much of its
start-up on a 2-core CPU importing torch, transformers and vLLM before it does anything (``python -X importtime``),
and chapter 08 asks vLLM's Python for three small jobs. It answers each request with one JSON line on
the stdout it was started with (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``); everything
vLLM itself prints goes to stderr, the caller's log. It imports nothing from labsupport (that venv need
not have it) and exits when stdin closes: its parent is done with it, or gone.
"""
import gc
import json
import os
import signal
import sys
import time
import traceback


def run_vllm_command(args: list) -> int:
    """``vllm ARGS...`` in this process; its exit status (``SystemExit`` is how argparse and the CLI end)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    before, sys.argv = sys.argv, ["vllm", *map(str, args)]  # vLLM's parsers read sys.argv too
    try:
        vllm_main()
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    finally:
        sys.argv = before
    return 0


def parse_serve_lines(lines: list) -> list:
    """Per ``ENV=... vllm serve MODEL FLAGS...`` line: its port, memory share, connector and role, whether the
    connector is registered, and the environment variables vLLM does not know."""
    import shlex

    from vllm import envs
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = []
    for line in lines:
        words = shlex.split(line)
        cut = words.index("serve")
        env = [w.split("=", 1)[0] for w in words[:cut - 1]]
        try:
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", *words[cut + 1:]])
        except SystemExit as refused:  # argparse's way; its message went to stderr
            raise ValueError(f"vllm serve's parser refused {line!r} (exit {refused.code}): see the log") from None
        kv = args.kv_transfer_config
        out.append({"unknown_env": [e for e in env if e not in envs.environment_variables], "port": args.port,
                    "gpu_memory_utilization": args.gpu_memory_utilization, "kv_connector": kv.kv_connector,
                    "kv_role": kv.kv_role, "connector_registered": kv.kv_connector in KVConnectorFactory._registry})
    return out


def serve(answers) -> None:
    from vllm_worker import greedy_tokens  # this script's neighbour (the script's folder is on sys.path)

    started = time.perf_counter()
    import vllm  # the imports every job needs, before the first one: torch, transformers, vLLM ...
    import vllm.benchmarks.serve  # noqa: F401  ... and `vllm bench serve`'s (not by `--help`: vLLM reads
    import vllm.entrypoints.cli.main  # noqa: F401  "--help" in sys.argv at import and changes its parsers)
    answers.write(json.dumps({"ok": True, "ready": True, "vllm_version": vllm.__version__,
                              "import_s": round(time.perf_counter() - started, 2)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        t0 = time.perf_counter()
        try:
            request = json.loads(line)
            if "greedy" in request:  # vLLM's CPU worker sets its own threads (VLLM_CPU_OMP_THREADS_BIND)
                answer = {"ok": True, **greedy_tokens(request["greedy"])}
                gc.collect()  # the LLM and its KV cache go now, not at some later collection
            elif "vllm" in request:
                import torch
                torch.set_num_threads(1)  # a client, as `servers.client_env` runs the command: off the servers' cores
                rc = run_vllm_command(request["vllm"])
                answer = {"ok": rc == 0, "rc": rc}
                if rc:
                    answer["error"] = f"vllm {' '.join(map(str, request['vllm'][:2]))} exited with status {rc}"
            elif "parse_serve" in request:
                answer = {"ok": True, "parsed": parse_serve_lines(request["parse_serve"])}
            else:
                answer = {"ok": False, "error": f"unknown request: {sorted(request)}"}
        except Exception as exc:  # the caller gets the error; the process stays for the next request
            traceback.print_exc()
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        answer["seconds"] = round(time.perf_counter() - t0, 3)
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    # SIGTERM (the lab's launcher sends it when the notebook that started us dies, ``labsupport.procs``) must
    # unwind like an exception, so that vLLM's exit handlers run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the answers keep the original stdout ...
    os.dup2(2, 1)  # ... and whatever vLLM prints (the benchmark's report, its logs) goes to stderr
    serve(replies)
