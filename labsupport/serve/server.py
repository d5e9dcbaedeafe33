"""``python -m labsupport serve``: uvicorn around the app, and a clean stop on SIGTERM or Ctrl-C.

On the signal, requests in flight end at once with an error (their clients learn why instead
of waiting on a stream that will never finish), uvicorn drains the connections, the app's
lifespan joins the engine thread, and the process exits 0: a stop asked for is not a crash,
so supervisors (systemd, Kubernetes, ``make``) do not report one. uvicorn re-raises the signal
it caught once it is done; the no-op handlers installed before it starts are what it restores,
so that re-raise ends nothing.
"""
from __future__ import annotations

import argparse
import signal

import uvicorn

GRACEFUL_SHUTDOWN_S = 10  # uvicorn waits this long for responses in flight before cancelling them
GPU_BATCHED_TOKENS = 2048  # vllm serve's default token budget per step (chunked prefill on)
CPU_BATCHED_TOKENS = 512  # 2-core CPU: bounds how long one prompt's step can stall the streams decoding beside it


def chunk_cost(text: str) -> int | str:
    """``--chunk-cost-context``: "auto" or a token count (EngineConfig checks that it is >= 0)."""
    return text if text == "auto" else int(text)


class LabServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.shutdown(wait=False)  # on the event loop's thread: only flags, never blocks
        super().handle_exit(sig, frame)


def serve(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> int:
    from .http_protocol import HeaderTimeoutProtocol
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=HeaderTimeoutProtocol,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = LabServer(config, app.state.engine)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


def add_serve_arguments(srv):
    """The ``serve`` flags beyond the engine's common ones, named as ``vllm serve`` names them."""
    srv.add_argument("model_tag", nargs="?", default=None, help="the model, as in `vllm serve MODEL` (or --model)")
    srv.add_argument("--api-key", action="append", default=[],
                     help="a key clients must send as 'Authorization: Bearer KEY' on /v1 (repeat for several; "
                          "each key is a tenant: no cached KV or results are shared between keys)")
    srv.add_argument("--api-key-file", default=None, help="more keys, one per line")
    srv.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                     help="prefix caching is on by default when serving, as in vllm serve")
    srv.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                     help="on by default, as in vllm serve: a long prompt is fed in chunks of the step's token budget "
                          "beside the decoding requests, so it never stalls them for a whole prefill")
    srv.add_argument("--long-prefill-token-threshold", type=int, default=0)
    srv.add_argument("--chunk-cost-context", type=chunk_cost, default="auto", metavar="K",
                     help="with chunked prefill, a prompt token attending to c earlier tokens takes 1 + c/K of the "
                          "step's token budget, so a long prompt's late chunks, whose attention reads the most, are "
                          "smaller (default auto: the context at which the model's attention FLOPs per token equal "
                          "its products', 3,072 for SmolLM2-135M; 0: every token counts 1, as in vllm serve)")
    srv.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help=f"tokens one step may feed (default: {GPU_BATCHED_TOKENS} on a GPU, as vllm serve's, "
                          f"{CPU_BATCHED_TOKENS} on the CPU, where a step of that size takes a few hundred ms)")
    srv.add_argument("--scheduling-policy", default="continuous", choices=["continuous", "fcfs", "static", "priority"],
                     help="continuous (or vLLM's name, fcfs): first come, first served; static: chapter 04's baseline (a batch "
                          "admitted together, held until it drains); priority: vLLM's, a request's 'priority' field "
                          "first (smaller sooner, default 0), then its arrival; memory short, the least urgent goes")
    srv.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                     help="the KV budget in bytes (paged: the pool's size; contiguous: a cap on what is reserved)")
    srv.add_argument("--speculative-config", default=None,
                     help="speculative decoding as JSON, vLLM's flag (chapter 09): "
                          "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 3}")
    srv.add_argument("--quantization", default=None, choices=["int8", "int4"],
                     help="weight-only quantization of our model (chapter 09)")
    srv.add_argument("--cpu-decode-kernel", action=argparse.BooleanOptionalAction, default=True,
                     help="CPU: attention reads K/V in place in compiled C++ kernels, decode rows and float32 "
                          "prefills (the default where a C++ compiler built them); --no-cpu-decode-kernel keeps "
                          "PyTorch's paths")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="requests waiting for a slot beyond this get 429 (0: no waiting at all)")
    srv.add_argument("--max-request-body-bytes", type=int, default=4 << 20, help="larger bodies get 413")
    srv.add_argument("--stream-send-timeout", type=float, default=30.0,
                     help="seconds a stream waits on a client that reads nothing before dropping it (its request "
                          "is aborted and its KV freed); 0: never")
    srv.add_argument("--engine-in-process", action="store_true",
                     help="step the engine in a thread of the server's process (chapter 06's first design) instead "
                          "of an engine-core process of its own (the default, as vLLM V1)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    pd = srv.add_argument_group("prefill/decode disaggregation (chapter 07)")
    pd.add_argument("--role", default=None, choices=["prefill", "decode", "both"],
                    help="run as a PD worker: a KV connector gives away (prefill) or fetches (decode) KV; "
                         "put `python -m labsupport router` in front. 'both' does either, as vLLM's kv_both")
    pd.add_argument("--kv-transfer-config", default=None,
                    help="the connector as JSON, vLLM's flag: {\"kv_connector\": \"TcpConnector\", \"kv_port\": 14579, ...}")
    pd.add_argument("--kv-port", type=int, default=0, help="TCP port of the KV server (0: any free port)")
    pd.add_argument("--kv-ip", default="127.0.0.1", help="address the KV server listens on and advertises")
    pd.add_argument("--kv-lease-s", type=float, default=30.0,
                    help="prefill: seconds a finished request's blocks wait for the decode worker's pull")
    pd.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                    help="decode: when a pull fails, compute the prompt here, or fail the request")
    pd.add_argument("--kv-events-config", default=None,
                    help="publish KV-cache events for KV-aware routers, vLLM's flag: {\"enable_kv_cache_events\": true, "
                         "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
                         "\"tcp://*:5558\", \"topic\": \"kv-events\"} (see labsupport/serve/kv_events.py)")
    pd.add_argument("--cpu-affinity", default=None,
                    help="pin this process to these CPUs (e.g. 0 or 0-1): on a 2-core machine give each worker one")
    srv.set_defaults(enable_prefix_caching=True)


def kv_transfer_config(args) -> dict | None:
    """The engine's ``kv_transfer_config`` from ``--kv-transfer-config`` and the ``--kv-*`` flags (None: no
    connector). Raises ValueError saying what is wrong."""
    if args.kv_transfer_config is None and args.role is None:
        return None
    config = json_flag(args.kv_transfer_config or None, "--kv-transfer-config") or {}
    roles = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both", None: "kv_both"}
    defaults = {"kv_connector": "TcpConnector", "kv_role": roles[args.role], "kv_ip": args.kv_ip,
                "kv_port": args.kv_port, "kv_lease_s": args.kv_lease_s,
                "kv_load_failure_policy": args.kv_load_failure_policy}
    return {**defaults, **config}


def json_flag(value: str | None, flag: str) -> dict | None:
    """A JSON-object flag (``--speculative-config``) -> dict; ValueError saying what is wrong."""
    import json
    if value is None:
        return None
    try:
        config = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return config


def kv_events_option(args) -> dict:
    """``{"kv_events_config": ...}`` for the engine core, or nothing when no events are published."""
    from .kv_events import parse_kv_events_config
    config = parse_kv_events_config(getattr(args, "kv_events_config", None))
    if config is None:
        return {}
    if args.engine_in_process:
        raise ValueError("--kv-events-config needs the engine core process: drop --engine-in-process")
    if not args.enable_prefix_caching or args.kv_cache != "paged":
        raise ValueError("--kv-events-config reports the prefix cache's blocks: it needs prefix caching (on by "
                         "default) and --kv-cache paged")
    return {"kv_events_config": config}


def pin_cpus(spec: str | None):
    """``--cpu-affinity 0`` or ``0-1`` or ``0,2``: this process (and torch's threads) runs on those CPUs only."""
    if spec is None:
        return
    import os

    import torch
    cpus = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        raise ValueError(f"--cpu-affinity {spec!r}: {exc}") from exc
    torch.set_num_threads(len(cpus))


def engine_options(args) -> dict:
    """The serve-only engine options; also resolves the positional model and checks the key file early
    (before the model loads), raising ValueError with what to fix."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    args.api_keys = [k for k in args.api_key if k]
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                args.api_keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
        except OSError as exc:
            raise ValueError(f"cannot read --api-key-file: {exc}") from exc
        if not args.api_keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    if args.max_num_batched_tokens is None:
        import torch
        gpu = args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())
        args.max_num_batched_tokens = GPU_BATCHED_TOKENS if gpu else CPU_BATCHED_TOKENS
    for name in ("max_waiting_requests", "max_request_body_bytes"):
        if getattr(args, name) < (1 if name == "max_request_body_bytes" else 0):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    pin_cpus(args.cpu_affinity)
    return dict(**kv_events_option(args), kv_transfer_config=kv_transfer_config(args),
                enable_prefix_caching=args.enable_prefix_caching and args.kv_cache == "paged",  # needs blocks
                enable_chunked_prefill=args.enable_chunked_prefill, max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold, chunk_cost_context=args.chunk_cost_context,
                scheduling_policy=args.scheduling_policy, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                speculative_config=json_flag(args.speculative_config, "--speculative-config"),
                quantization=args.quantization, cpu_decode_kernel=args.cpu_decode_kernel)


def run_server(source, args) -> int:
    """Serve ``source``: an ``LLM`` (``--engine-in-process``) or an ``EngineCoreClient``."""
    from .api import create_app
    app = create_app(source, args.served_model_name, api_keys=args.api_keys,
                     max_waiting_requests=args.max_waiting_requests, max_request_body_bytes=args.max_request_body_bytes,
                     stream_send_timeout=args.stream_send_timeout or None)
    try:
        return serve(app, args.host, args.port, args.log_level)
    finally:
        app.state.engine.shutdown()  # the engine core goes with the server, also when uvicorn could not start


def start_engine_core(options: dict, args):
    """``python -m labsupport serve``'s engine: a core process for these engine options (raises
    ``EngineCoreStartError``; ``bad_option`` for a ValueError the CLI reports with exit code 2)."""
    from .core_client import EngineCoreClient
    from ..result_cache import ResultCache
    cache = ResultCache() if args.enable_result_cache else None
    return EngineCoreClient(options, args.served_model_name, args.max_waiting_requests, result_cache=cache)