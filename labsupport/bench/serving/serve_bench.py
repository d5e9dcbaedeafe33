"""A load generator for any OpenAI-compatible server, ours or ``vllm serve``: ``bench serve``.

The engine-side numbers of ``bench`` (chapters 04-05) leave out what a user feels: HTTP,
JSON, server-side tokenization, the event loop. This client measures from the outside, as
``vllm bench serve`` does, so the same command compares our server with vLLM's:

    results = benchmark("http://127.0.0.1:8000", "SmolLM2-135M-Instruct",
                        sample_requests(load_tokenizer(), "random", 32, 128, 64), rate=4.0)

Per request, from the streamed chunks: TTFT (send to first text), ITL (every gap between text
chunks), TPOT ((E2E - TTFT) / (output tokens - 1)), E2E latency. ``summarize`` turns them
into the mean/P50/P90/P99, throughputs and goodput; ``serve_cli`` prints and saves them.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from ...percentiles import percentile
from .serve_datasets import SampleRequest, arrival_times
from .serve_metrics import scrape_server_metrics, server_metrics_delta

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    prompt_len: int
    output_len: int  # requested
    success: bool = False
    error: str = ""
    start_time: float = 0.0  # perf_counter when sent
    ttft: float = 0.0
    latency: float = 0.0  # E2E: send to the last token's chunk
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # the server's usage count; the number of text chunks if it sends none
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details), 0 if unsaid
    generated_text: str = ""

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first; 0 for a one-token answer (as vLLM counts it)."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def goodput(results: list[RequestResult], slo: dict[str, float], duration_s: float | None = None) -> float:
    """Requests per second that succeeded *and* met every SLO (``{"ttft": ms, "tpot": ms, "e2el": ms}``).

    Throughput counts every answer; goodput only those a user would call fast enough, so pushing
    the rate past the knee raises throughput while goodput falls. ``duration_s`` defaults to the span
    from the first send to the last answer."""
    measured = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot, "e2el": lambda r: r.latency}
    unknown = set(slo) - set(measured)
    if unknown:
        raise ValueError(f"unknown SLO metrics {sorted(unknown)}: use ttft, tpot, e2el (milliseconds)")
    done = [r for r in results if r.success]
    if duration_s is None:
        duration_s = max(r.start_time + r.latency for r in done) - min(r.start_time for r in done) if done else 0.0
    good = [r for r in done if all(measured[k](r) * 1000 <= limit for k, limit in slo.items())]
    return len(good) / duration_s if duration_s > 0 else 0.0


@dataclass
class BenchResult:
    """One run at one rate: its settings, the summary (vLLM's key names), and every request."""

    config: dict
    summary: dict
    requests: list[RequestResult]

    def __getitem__(self, key):  # result["p99_ttft_ms"]
        return self.summary[key]

    def to_json(self) -> dict:
        per_request = {"ttfts": [r.ttft for r in self.requests], "itls": [r.itl for r in self.requests],
                       "e2els": [r.latency for r in self.requests], "input_lens": [r.prompt_len for r in self.requests],
                       "output_lens": [r.output_tokens for r in self.requests],
                       "errors": [r.error for r in self.requests]}
        return _strict({**self.config, **self.summary, **per_request})


def _strict(obj):
    """JSON without NaN/Infinity, which strict parsers reject: a rate of inf is "inf" (as vLLM writes it)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj == math.inf else None
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict(v) for v in obj]
    return obj


def payload(endpoint: str, model: str, req: SampleRequest, ignore_eos: bool, temperature: float | None) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:  # vLLM's extension; false is its default, and a strict server (transformers serve) refuses the key
        body["ignore_eos"] = True
    if endpoint == CHAT:
        body.update(messages=[{"role": "user", "content": req.prompt}], max_completion_tokens=req.output_len)
        if not ignore_eos:  # a server without vLLM's extensions may read only the older name (transformers serve)
            body["max_tokens"] = req.output_len
    else:
        body.update(prompt=req.prompt, max_tokens=req.output_len)
    if temperature is not None:
        body["temperature"] = temperature
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict, req: SampleRequest) -> RequestResult:
    """POST one streaming request and time its server-sent events; never raises."""
    out = RequestResult(req.prompt_len, req.output_len)
    chunks, last = 0, 0.0
    out.start_time = start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines between events, ": ping" comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now, obj = time.perf_counter(), json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"].get("message", obj["error"]))[:300]
                    return out
                if obj.get("usage"):
                    out.output_tokens = obj["usage"].get("completion_tokens") or 0
                    out.prompt_len = obj["usage"].get("prompt_tokens") or out.prompt_len
                    out.cached_tokens = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in obj.get("choices") or []:
                    text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                    if text:  # a role-only first chunk is no token: TTFT waits for text
                        if chunks == 0:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        chunks, last = chunks + 1, now
                        out.generated_text += text
                    elif choice.get("finish_reason") and chunks:
                        last = now
        if chunks == 0:
            out.error = "no text chunk received"
            return out
        out.latency, out.output_tokens = last - start, out.output_tokens or chunks
        out.success = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:300]
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: dict | None = None,
              usd_per_hour: float | None = None) -> dict:
    """vLLM's summary of a run: counts, throughputs, mean/median/P90/P99 of each latency (ms)."""
    done = [r for r in results if r.success]
    n_in, n_out = sum(r.prompt_len for r in done), sum(r.output_tokens for r in done)
    s = {"completed": len(done), "failed": len(results) - len(done), "duration": duration_s,
         "total_input_tokens": n_in, "total_output_tokens": n_out,
         "request_throughput": len(done) / duration_s, "output_throughput": n_out / duration_s,
         "total_token_throughput": (n_in + n_out) / duration_s,
         "first_errors": list(dict.fromkeys(r.error for r in results if not r.success))[:5]}
    series = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.output_tokens > 1],
              "itl": [g for r in done for g in r.itl], "e2el": [r.latency for r in done]}
    for name, values in series.items():
        ms = [v * 1000 for v in values]
        s[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else math.nan
        for label, q in (("median", 50), ("p90", 90), ("p99", 99)):
            s[f"{label}_{name}_ms"] = percentile(ms, q)
        s[f"max_{name}_ms"], s[f"n_{name}"] = (max(ms) if ms else math.nan), len(ms)   # what percentiles.tail reads
    if slo:
        s["request_goodput"] = goodput(results, slo, duration_s)
    if usd_per_hour is not None:
        s["usd_per_million_output_tokens"] = usd_per_hour / 3600 / s["output_throughput"] * 1e6 if n_out else math.nan
    return s


def auth_headers() -> dict:
    """``Authorization`` from ``OPENAI_API_KEY``, as ``vllm bench serve`` and the openai client read it."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def run_benchmark(base_url: str, model: str, requests: list[SampleRequest], rate: float = math.inf,
                        burstiness: float = 1.0, max_concurrency: int | None = None, endpoint: str = CHAT,
                        ignore_eos: bool = True, temperature: float | None = 0.0, slo: dict | None = None,
                        usd_per_hour: float | None = None, seed: int = 0, progress: bool = True,
                        timeout_s: float = 600.0, test_request: bool = True) -> BenchResult:
    """Send ``requests`` at ``rate`` per second (gamma gaps of shape ``burstiness``), at most
    ``max_concurrency`` in flight; wait for all; return their timings and the summary.

    ``/metrics`` is read before and after (when the server has one) for the prefix-cache hit rate
    and the mean queue time, which only the server knows. ``test_request`` first sends one tiny
    request (not a workload prompt: it would warm the prefix cache) so that a wrong URL, model or
    endpoint is one clear error instead of ``len(requests)`` failures."""
    from tqdm.auto import tqdm

    base_url = base_url.rstrip("/").removesuffix("/v1")
    times = arrival_times(len(requests), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    conns = httpx.Limits(max_connections=max_concurrency or max(len(requests), 1), max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=conns, headers=auth_headers()) as client:
        if test_request:
            probe = SampleRequest("Hello", 1, 2)
            first = await send_request(client, base_url + endpoint,
                                       payload(endpoint, model, probe, ignore_eos, temperature), probe)
            if not first.success:
                raise RuntimeError(f"test request to {base_url + endpoint} (model {model!r}) failed: {first.error}")
        before = await scrape_server_metrics(client, base_url)
        bar = tqdm(total=len(requests), desc=f"rate {rate}", unit="req", disable=not progress)

        async def one(req: SampleRequest, at: float, t0: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            body = payload(endpoint, model, req, ignore_eos, temperature)
            if limit is None:
                result = await send_request(client, base_url + endpoint, body, req)
            else:
                async with limit:
                    result = await send_request(client, base_url + endpoint, body, req)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r, at, t0) for r, at in zip(requests, times)))
        duration = time.perf_counter() - t0
        bar.close()
        after = await scrape_server_metrics(client, base_url)
    summary = summarize(results, duration, slo, usd_per_hour)
    summary.update(server_metrics_delta(before, after))
    config = {"base_url": base_url, "endpoint": endpoint, "model": model, "num_prompts": len(requests),
              "request_rate": rate, "burstiness": burstiness, "max_concurrency": max_concurrency,
              "ignore_eos": ignore_eos, "temperature": temperature, "slo": slo or {}, "usd_per_hour": usd_per_hour}
    return BenchResult(config, summary, list(results))


def benchmark(*args, **kwargs) -> BenchResult:
    """``run_benchmark`` from synchronous code, Jupyter included: a notebook's kernel already runs an
    event loop, where ``asyncio.run`` refuses to start, so then it runs in a thread of its own.

    Interrupting it (Ctrl-C, the notebook's stop button) cancels the requests in flight, whose closed
    connections make the server abort them, and raises KeyboardInterrupt at once, instead of waiting for
    the rate's last answer (longer still when a pool's exit joined the thread). ``asyncio.run`` does the same
    outside a notebook."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_benchmark(*args, **kwargs))
    return run_in_thread(run_benchmark(*args, **kwargs))


CANCEL_WAIT_S = 2.0  # after an interrupt: how long the cancelled requests may take to close their connections


def run_in_thread(coro):
    """``coro``'s result, run on an event loop in a thread of its own; an interrupt of the waiting caller
    cancels it, waits ``CANCEL_WAIT_S`` at most for it to unwind, and goes on."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    outcome, done = {}, threading.Event()

    def run():
        try:
            outcome["result"] = loop.run_until_complete(task)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller)
            outcome["error"] = exc
        finally:
            loop.close()
            done.set()

    threading.Thread(target=run, name="bench-serve", daemon=True).start()
    try:  # an Event, not Thread.join: an interrupted join leaves the thread looking finished while it runs on
        done.wait()  # interruptible: a signal raises KeyboardInterrupt here
    except BaseException:
        if not done.is_set():
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # it ended meanwhile: its loop is closed
                pass
            done.wait(CANCEL_WAIT_S)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def request_dicts(result: BenchResult) -> list[dict]:
    """Every request as a plain dict (for a DataFrame in the notebook)."""
    return [{**asdict(r), "tpot": r.tpot} for r in result.requests]
