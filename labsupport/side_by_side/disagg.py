"""Chapter 07's prefill/decode split, done by vLLM: two ``vllm serve`` behind chapter 07's own router.

On a CPU the only connector that works both ways is **ExampleConnector**: the producer writes each
prompt's KV, layer by layer, as safetensors files under ``shared_storage_path``, named by a hash of
the prompt's tokens; the consumer looks the same hash up and loads the files instead of computing
the prompt. So it needs no ``kv_transfer_params`` (its prefill answer carries ``null``) and the
router runs with ``--kv-params optional``. It moves whole blocks only, of all but the last prompt
token or two: with the CPU's default block size of 128 a prompt under 130 tokens transfers
nothing, hence ``--block-size 32`` (the CPU attention wants a multiple of 32; 100 tokens: 96
travel). The producer names what it saves by ``floor((n-1)/32)*32`` tokens and the consumer looks
for ``floor((n-2)/32)*32``: for n = 32k + 1 (33, 65, 97, ...) the two differ and the consumer
silently computes the whole prompt itself. A debugging connector, not a product: it never deletes
a file either, so each deployment gets a fresh folder, removed when it stops.

``VllmPD`` starts and stops the three processes (producer on core 0, consumer on core 1, the router)
and always removes the folder: on ``stop()``, at the end of a ``with`` block even when a cell fails,
and at interpreter exit for a notebook that never reached its ``stop()``. ``toy_proxy_request`` is
vLLM's proxy protocol in a few lines, without our router; ``prompt_token_sources`` reads from the
consumer's ``/metrics`` how many prompt tokens it computed and how many it loaded. ``nixl_recipe``
is the GPU version (NixlConnector), as command lines, and ``check_recipe`` has the installed vLLM's
own argument parser read them, since no GPU is at hand to run them on.
"""
from __future__ import annotations

import atexit
import json
import shlex
import shutil
import tempfile
from pathlib import Path

import httpx

from ..pd.cluster import Router, start_all, stop_all
from ..servers import VllmServer

BLOCK_SIZE = 32  # CPU attention: a multiple of 32; small enough that a 100-token prompt fills 3 blocks
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vllm:prompt_tokens_by_source


def example_connector_args(role: str, storage: str | Path) -> list[str]:
    """The ``vllm serve`` flags of one side: ``role`` is "kv_producer" or "kv_consumer"."""
    config = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ["--block-size", str(BLOCK_SIZE), "--kv-transfer-config", json.dumps(config)]


class VllmPD:
    """A producer (prefill, core 0) and a consumer (decode, core 1) sharing a fresh storage folder, and
    ``python -m labsupport router`` in front (``router=False``: none; use ``toy_proxy_request``).

    ``with VllmPD(model) as pd: httpx.post(pd.url + "/v1/completions", ...)``, or ``pd.start()`` ...
    ``pd.stop()``. ``url`` is the router's; ``producer``/``consumer`` are ``VllmServer``s."""

    def __init__(self, model, name: str = "smol", cpus=("0", "1"), router: bool = True, kv_space_gib: int = 1,
                 max_model_len: int = 2048, args: list[str] | tuple = ()):
        self.storage = Path(tempfile.mkdtemp(prefix="labsupport-vllm-kv-"))

        def side(role: str, cpu: str) -> VllmServer:
            return VllmServer(model, name, cpu, args=[*example_connector_args(role, self.storage), *args],
                              kv_space_gib=kv_space_gib, max_model_len=max_model_len)
        self.producer, self.consumer = side("kv_producer", cpus[0]), side("kv_consumer", cpus[1])
        self.router = Router(prefill=[self.producer], decode=[self.consumer],
                             args=["--kv-params", "optional", "--log-level", "warning"]) if router else None
        atexit.register(self.stop)

    @property
    def workers(self) -> list:
        return [self.producer, self.consumer] + ([self.router] if self.router else [])

    @property
    def url(self) -> str:
        return self.router.url if self.router else self.consumer.url

    def start(self, timeout: float = 300.0) -> "VllmPD":
        """All at once (the router is healthy as soon as both vLLMs are); on any failure everything is
        stopped and the folder removed before the error goes on."""
        try:
            start_all(self.workers, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self):
        """Stop all three and remove the storage folder; safe to call twice, or before ``start``."""
        try:
            stop_all(self.workers)
        finally:
            for server in (self.producer, self.consumer):
                server.reap()
            shutil.rmtree(self.storage, ignore_errors=True)
            atexit.unregister(self.stop)

    def stored_prompts(self) -> int:
        """How many prompts the producer has written KV for (one folder each)."""
        return sum(1 for p in self.storage.iterdir() if p.is_dir()) if self.storage.exists() else 0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def toy_proxy_request(prefill_url: str, decode_url: str, body: dict, path: str = "/v1/completions",
                      timeout: float = 300.0) -> dict:
    """vLLM's toy proxy, for one non-streamed request: the prompt on the prefill side (one token, "keep
    the KV for a remote decode"), then the original request on the decode side, with the
    ``kv_transfer_params`` the prefill side answered, if any (ExampleConnector: none)."""
    first = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    if "max_completion_tokens" in body:
        first["max_completion_tokens"] = 1
    first.pop("stream_options", None)
    with httpx.Client(timeout=timeout) as client:
        prefilled = client.post(prefill_url.rstrip("/") + path, json=first)
        prefilled.raise_for_status()
        kv = prefilled.json().get("kv_transfer_params")
        second = {**body, "stream": False, **({"kv_transfer_params": kv} if kv else {})}
        decoded = client.post(decode_url.rstrip("/") + path, json=second)
        decoded.raise_for_status()
        return decoded.json()


def prompt_token_sources(server) -> dict[str, float]:
    """Prompt tokens a vLLM server has seen, by where their KV came from (``vllm:prompt_tokens_by_source``):
    ``local_compute`` (prefilled here), ``local_cache_hit`` (its own prefix cache) and
    ``external_kv_transfer`` (loaded through the connector), plus ``external_prefix_cache_hits``/
    ``_queries`` (what the connector was asked for and found). ``server``: a ``VllmServer`` or a URL."""
    from prometheus_client.parser import text_string_to_metric_families
    url = server.url if hasattr(server, "url") else str(server).rstrip("/")
    counts = dict.fromkeys([*SOURCES, "external_prefix_cache_hits", "external_prefix_cache_queries"], 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5.0).text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total" and sample.labels.get("source") in SOURCES:
                counts[sample.labels["source"]] += sample.value
            elif sample.name in ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"):
                counts[sample.name[len("vllm:"):-len("_total")]] += sample.value
    return counts


def external_hit_tokens(server) -> int:
    """Prompt tokens whose KV the server loaded from another instance instead of computing them."""
    return int(prompt_token_sources(server)["external_kv_transfer"])


def log_external_hits(server: VllmServer) -> int:
    """How often ExampleConnector logged "External Cache Hit!" in the server's log (the same fact, as text)."""
    try:
        return Path(server.log_path).read_text(errors="replace").count("External Cache Hit!")
    except OSError:
        return 0


def nixl_recipe(model: str, gpu_memory_utilization: float = 0.4, name: str = "smol", ports=(8100, 8200, 8000),
                side_channel_ports=(5600, 5601)) -> list[str]:
    """The GPU deployment as shell lines: producer, consumer, router. NixlConnector (``pip install nixl``)
    moves the KV GPU to GPU, and its prefill answer says where the blocks are, so the router keeps its
    default ``--kv-params required``. Both share one GPU: each takes ``gpu_memory_utilization`` of
    its memory (two 0.4 fit; start the producer first, so that the consumer's memory profiling
    counts the producer's share as taken), and each needs its own NIXL side channel port, where
    the consumer asks the producer for its memory layout. vLLM 0.32 deprecates ``kv_both`` for
    NixlConnector (it warns): the roles are ``kv_producer`` and ``kv_consumer``."""
    lines = []
    for role, side, port in zip(("kv_producer", "kv_consumer"), side_channel_ports, ports):
        config = shlex.quote(json.dumps({"kv_connector": "NixlConnector", "kv_role": role}))
        lines.append(f"VLLM_NIXL_SIDE_CHANNEL_PORT={side} vllm serve {shlex.quote(str(model))} --port {port} "
                     f"--served-model-name {name} --gpu-memory-utilization {gpu_memory_utilization} "
                     f"--kv-transfer-config {config}")
    return lines + [f"python -m labsupport router --prefill http://127.0.0.1:{ports[0]} "
                    f"--decode http://127.0.0.1:{ports[1]} --port {ports[2]}"]


def check_recipe(lines: list[str], timeout: float = 120.0, session=None) -> list[dict]:
    """What the installed vLLM's own ``vllm serve`` parser makes of each ``vllm serve`` line of a recipe
    (a wrong flag name fails here, not on the GPU machine): port, memory share, connector and role,
    whether the connector is registered and which environment variables vLLM does not know. ``session``: a
    running ``session.VllmSession`` to ask (vLLM already imported there); by default one just for this."""
    from .session import VllmSession

    serve_lines = [line for line in lines if " vllm serve " in f" {line} "]
    if session is not None:
        return session.parse_serve(serve_lines, timeout)
    with VllmSession() as own:
        return own.parse_serve(serve_lines, timeout)
