"""Prometheus metrics for the chapter 06 server, named, typed, labelled and bucketed as vLLM's.

Every metric vLLM exposes as ``vllm:<name>`` that means something for our engine is exposed here
as ``labsupport:<name>``: the same type, help text, labels (``model_name`` and ``engine="0"``,
plus ``finished_reason`` or ``source`` where vLLM has them) and histogram buckets (copied from
vLLM 0.32's ``vllm/v1/metrics/buckets.py``; the token-count histograms use vLLM's 1-2-5 series up
to ``max_model_len``). One Grafana dashboard or PromQL query reads both servers by swapping the
prefix::

    rate(labsupport:generation_tokens_total[1m])       rate(vllm:generation_tokens_total[1m])
    histogram_quantile(0.99, rate(labsupport:time_to_first_token_seconds_bucket[1m]))

The values mean what vLLM's mean: ``prompt_tokens_total`` counts each request's whole prompt once,
when its first token comes out (cached tokens included); the prefix-cache counters count tokens
at a request's first admission (a preempted request finding its own blocks again is not a hit);
the request histograms are observed when the request finishes (``on_finished``), the
time-to-first-token and inter-token histograms as each token comes out (``on_step``). An ``n > 1``
request's samples are requests of their own here, as vLLM's child requests are, except for
``request_params_n`` and ``request_max_num_generation_tokens``: those are observed once per request
(``n``, and the most tokens any of its samples generated) when its last sample finishes, as vLLM
observes them (for ``n = 1`` too: 1, and its own tokens). Our own
additions, which vLLM does not have: ``labsupport:prompt_tokens_computed_total`` (prompt tokens
actually run through the model: cache hits excluded, recomputation after a preemption counted
again: the work prefix caching saves) and ``labsupport:kv_cache_free_blocks``.

Not exposed, because our engine has no such thing (``NOT_IMPLEMENTED`` lists them): LoRA,
multi-modal, KV fetch stages, watermarking, NaN detection, sleep mode, admission limits, KV block
residency sampling. As on vLLM's ``/metrics``, the process's own metrics come too
(prometheus_client's ``process_*`` for this process: CPU seconds, resident memory, open files;
``python_gc_*`` and ``python_info``); ``labsupport:cache_config_info`` is vLLM's info gauge (always
1) whose labels are the KV cache's settings under vLLM's ``CacheConfig`` names.

The server's engine-loop thread calls ``on_step`` after every ``engine.step()`` and
``on_finished`` for every request that finished (done, stopped, aborted, failed); the HTTP thread
calls ``render`` for ``GET /metrics``. Each ``ServerMetrics`` has its own registry by default,
so several servers in one process (a notebook, the tests) do not clash.

The names, help texts and buckets are data, in ``metrics_catalog.py``; reading an exposition back
(``parse_metrics``, still importable from here) is ``metrics_parse.py``.
"""
from __future__ import annotations

import logging
import time
import weakref

from prometheus_client import (CONTENT_TYPE_LATEST, GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry, Counter, Gauge, Histogram, generate_latest)

from .metrics_catalog import (CACHE_CONFIG_LABELS, CONNECTOR_COUNTERS, COUNTERS, DEFAULT_MAX_MODEL_LEN, GAUGES,
                              HISTOGRAMS, INFO, LABELLED_COUNTERS, LABELLED_GAUGES, LABELS, PREFIX, SPEC_COUNTERS,
                              request_tokens_buckets)
from .metrics_parse import parse_metrics  # noqa: F401  (notebooks import it from here)

log = logging.getLogger(__name__)


class ServerMetrics:
    """The server's Prometheus metrics, fed from its engine-loop thread, read by ``render``.

    ``max_model_len`` sizes the token-count histograms' buckets as vLLM does: pass the engine's
    (``engine.max_model_len``); the default is the engine's default cap.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 max_model_len: int | None = None):
        self.model_name = model_name
        self.max_model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = (model_name, "0")
        token_buckets = request_tokens_buckets(self.max_model_len)
        self.gauges = {n: Gauge(PREFIX + n, doc, LABELS, registry=self.registry).labels(*labels)
                       for n, doc in GAUGES.items()}
        self.counters = {n: Counter(PREFIX + n, doc, LABELS, registry=self.registry).labels(*labels)
                         for n, doc in COUNTERS.items()}
        self.labelled, self._families = {}, {}
        for n, (doc, label, values) in LABELLED_COUNTERS.items():
            family = self._families[n] = Counter(PREFIX + n, doc, (*LABELS, label), registry=self.registry)
            self.labelled[n] = {v: family.labels(*labels, v) for v in values}  # all exposed from the start, as vLLM
        for n, (doc, label, values) in LABELLED_GAUGES.items():
            family = Gauge(PREFIX + n, doc, (*LABELS, label), registry=self.registry)
            self.labelled[n] = {v: family.labels(*labels, v) for v in values}
        self.info = {n: Gauge(PREFIX + n, doc, CACHE_CONFIG_LABELS, registry=self.registry) for n, doc in INFO.items()}
        if registry is None:  # the process's own metrics, as vLLM's /metrics has them (the shared collectors)
            for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR):
                self.registry.register(collector)
        self.histograms = {n: Histogram(PREFIX + n, doc, LABELS, registry=self.registry,
                                        buckets=token_buckets if buckets is None else buckets).labels(*labels)
                           for n, (doc, buckets) in HISTOGRAMS.items()}
        self._last_step = None  # the last SchedulerOutput counted: an idle step's stale one is not counted twice
        self._engine = None  # the engine of the last on_step: on_finished refreshes the gauges from it
        self._finished: weakref.WeakSet = weakref.WeakSet()  # requests already counted by on_finished
        self._parent_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a forked sample -> its request
        self._families: weakref.WeakSet = weakref.WeakSet()  # requests whose n was observed (all samples done)
        self._warned_len = False
        self._connector_seen: dict[str, int] = {}  # connector totals already counted
        self._spec_seen: dict = {}  # the engine's spec-decode totals already counted
        self._per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                (*LABELS, "position"), registry=self.registry)

    # ------------------------------------------------------------------ fed by the engine loop

    def on_step(self, engine, requests_with_new_token, scheduler_output):
        """After ``engine.step()``: ``requests_with_new_token`` is what it returned, ``scheduler_output``
        the step's ``SchedulerOutput`` (``engine.last_step``; None, or the previous step's, when the
        step ran nothing: then only the gauges are updated)."""
        self._engine = engine
        self._update_gauges(engine)
        out = scheduler_output
        if out is None or out is self._last_step:
            return
        self._last_step = out
        if engine.max_model_len != self.max_model_len and not self._warned_len:
            self._warned_len = True
            log.warning("ServerMetrics was made for max_model_len=%d but the engine's is %d: token histogram "
                        "buckets differ from vLLM's for it", self.max_model_len, engine.max_model_len)
        keeps_kv = engine.kv.keeps_kv
        caching = getattr(engine.kv, "prefix_cache", None) is not None
        computed = queries = hits = 0
        for req, n in zip(out.requests, out.num_new_tokens):
            start = req.num_computed_tokens - n if keeps_kv else 0  # computed before this step
            computed += max(0, min(len(req.prompt_token_ids), start + n) - start)
            first_scheduled = req.metrics.first_scheduled_time
            if caching and first_scheduled is not None and first_scheduled >= out.start and req.num_preemptions == 0:
                queries += len(req.prompt_token_ids)  # first admitted this step, as the engine counts
                hits += req.metrics.num_cached_tokens
                self._count_hit_sources(req)
        prompt = cached = 0
        for req in requests_with_new_token:
            self._note_samples(req)
            times = req.metrics.token_times
            prompt_only = not req.output_token_ids and getattr(req.params, "max_tokens", 1) == 0  # scored, no token
            if len(req.output_token_ids) == 1 or prompt_only:  # its first token (or none to come): the prefill is done
                p, c, ext = len(req.prompt_token_ids), req.metrics.num_cached_tokens, req.remote_kv.num_external_tokens
                prompt, cached = prompt + p, cached + c
                self.labelled["prompt_tokens_by_source"]["local_compute"].inc(p - c)
                self.labelled["prompt_tokens_by_source"]["local_cache_hit"].inc(c - ext)
                self.labelled["prompt_tokens_by_source"]["external_kv_transfer"].inc(ext)
                if not prompt_only:
                    self.histograms["time_to_first_token_seconds"].observe(req.metrics.first_token_time
                                                                           - req.metrics.arrival_time)
            elif len(times) >= 2:  # accepted guesses (chapter 09): several tokens, several gaps (0 within a step)
                m = min(max(1, getattr(req, "num_new_output_tokens", 1)), len(times) - 1)
                for before, after in zip(times[-m - 1:-1], times[-m:]):
                    self.histograms["inter_token_latency_seconds"].observe(after - before)
        c = self.counters
        c["prompt_tokens"].inc(prompt)
        c["prompt_tokens_cached"].inc(cached)
        c["prompt_tokens_computed"].inc(computed)
        c["generation_tokens"].inc(sum(max(1, getattr(r, "num_new_output_tokens", 1)) for r in requests_with_new_token
                                       if r.output_token_ids))  # a prompt-only request (max_tokens=0) made none
        self._count_speculation(engine)
        c["prefix_cache_queries"].inc(queries)
        c["prefix_cache_hits"].inc(hits)
        c["num_preemptions"].inc(len(out.preempted))
        self.histograms["iteration_tokens_total"].observe(out.total_tokens)

    def _count_speculation(self, engine):
        """The engine's spec-decode totals (chapter 09) -> counter increments, per position too."""
        totals = engine.scheduler.lifecycle.counters
        for name in SPEC_COUNTERS:
            if name in totals:
                self.counters[name].inc(totals[name] - self._spec_seen.get(name, 0))
                self._spec_seen[name] = totals[name]
        for pos, value in enumerate(totals.get("spec_decode_num_accepted_tokens_per_pos", [])):
            key = ("per_pos", pos)
            self._per_pos.labels(self.model_name, "0", str(pos)).inc(value - self._spec_seen.get(key, 0))
            self._spec_seen[key] = value

    def _count_hit_sources(self, req):
        """A first admission's cached prompt tokens by tier: ``host`` copied back from the CPU tier
        (chapter 03), ``p2p`` pulled from another engine (chapter 07), ``device`` the pool's own."""
        host, ext = req.kv.num_host_cached_tokens, req.remote_kv.num_external_tokens
        by_source = self.labelled["prompt_tokens_cached_by_source"]
        by_source["host"].inc(host)
        by_source["p2p"].inc(ext)
        by_source["device"].inc(max(0, req.metrics.num_cached_tokens - host - ext))

    def _set_cache_config(self, engine):
        """``cache_config_info``: set once, from the engine's configuration and pool."""
        c = engine.config
        info = {"block_size": c.block_size if c.kv_cache == "paged" else None,
                "gpu_memory_utilization": c.gpu_memory_utilization, "cache_dtype": "auto",
                "num_gpu_blocks_override": c.num_blocks, "enable_prefix_caching": c.enable_prefix_caching,
                "num_gpu_blocks": engine.kv.stats().get("kv_blocks_total"), "num_cpu_blocks": c.cpu_offload_blocks,
                "kv_cache_memory_bytes": c.kv_cache_memory_bytes, "engine": "0"}
        self.info["cache_config_info"].labels(**{k: str(v) for k, v in info.items()}).set(1)
        self._cache_config_set = True

    _cache_config_set = False

    def _update_gauges(self, engine):
        if not self._cache_config_set and hasattr(engine, "config"):
            self._set_cache_config(engine)
        g = self.gauges
        queues = engine.scheduler.queues
        g["num_requests_running"].set(len(queues.running))
        loading = sum(not r.is_finished for r in queues.loading.values())
        g["num_requests_waiting"].set(len(queues.waiting) + loading)  # KV on its way: waiting too (vLLM)
        waiting = self.labelled["num_requests_waiting_by_reason"]
        waiting["capacity"].set(len(queues.waiting))
        waiting["deferred"].set(loading)
        connector = getattr(engine, "connector", None)
        if connector is not None:
            g["kv_requests_held"].set(len(queues.held))
            for name in CONNECTOR_COUNTERS:  # the connector's totals -> counter increments
                value = connector.counters.get(name, 0)
                self.counters[name].inc(max(0, value - self._connector_seen.get(name, 0)))
                self._connector_seen[name] = value
        stats = engine.kv.stats()
        total, free = stats.get("kv_blocks_total", 0), stats.get("kv_blocks_free", 0)
        g["kv_cache_usage_perc"].set(1 - free / total if total else 0.0)
        g["kv_cache_free_blocks"].set(free)

    def _note_samples(self, req):
        """Remember which request a forked sample belongs to (it forks in the step of its request's first token)."""
        for sample in getattr(req, "samples", ()):
            self._parent_of.setdefault(sample, req)

    def _observe_family(self, request):
        """``request_params_n`` and ``request_max_num_generation_tokens``, once the request and all its samples
        have finished (a request that ended before it forked has no samples to wait for)."""
        parent = self._parent_of.get(request, request)
        family = [parent, *getattr(parent, "samples", ())]
        if parent in self._families or any(r.finish_reason is None for r in family):
            return
        self._families.add(parent)
        self.histograms["request_params_n"].observe(getattr(parent.params, "n", 1))
        self.histograms["request_max_num_generation_tokens"].observe(max(len(r.output_token_ids) for r in family))

    def on_finished(self, request):
        """Once per finished request (done, stopped, aborted, failed); a second call is ignored. The
        gauges are refreshed too: a request aborted between steps leaves no step behind to do it."""
        if self._engine is not None:
            self._update_gauges(self._engine)
        if request.finish_reason is None:
            log.warning("on_finished for request %s, which has not finished: ignored", request.request_id)
            return
        if request in self._finished:
            return
        self._finished.add(request)
        self._note_samples(request)
        self._observe_family(request)
        m = request.metrics
        end = m.finished_time if m.finished_time is not None else time.perf_counter()
        scheduled, first = m.first_scheduled_time, m.first_token_time
        last = m.token_times[-1] if m.token_times else None
        # vLLM's phases: queued = arrival -> first scheduled, prefill = -> first token, decode = first ->
        # last token, inference = prefill + decode. A phase the request never reached lasts 0; one it
        # was in when it ended (aborted, failed) lasts until then.
        queued = (scheduled if scheduled is not None else end) - m.arrival_time
        prefill = (first if first is not None else end) - scheduled if scheduled is not None else 0.0
        decode = last - first if first is not None else 0.0
        inference = (last if last is not None else end) - scheduled if scheduled is not None else 0.0
        n_out, n_prompt = len(request.output_token_ids), len(request.prompt_token_ids)
        h = self.histograms
        h["e2e_request_latency_seconds"].observe(end - m.arrival_time)
        h["request_queue_time_seconds"].observe(queued)
        h["request_prefill_time_seconds"].observe(prefill)
        h["request_decode_time_seconds"].observe(decode)
        h["request_inference_time_seconds"].observe(inference)
        h["request_time_per_output_token_seconds"].observe(decode / (n_out - 1) if n_out > 1 else 0.0)
        h["request_prompt_tokens"].observe(n_prompt)
        h["request_generation_tokens"].observe(n_out)
        h["request_num_preemptions"].observe(request.num_preemptions)
        h["request_prefill_kv_computed_tokens"].observe(n_prompt - request.metrics.num_cached_tokens)
        h["request_params_max_tokens"].observe(request.params.max_tokens)
        reasons = self.labelled["request_success"]
        if request.finish_reason not in reasons:  # not one of vLLM's: counted under its own name
            reasons[request.finish_reason] = self._families["request_success"].labels(
                self.model_name, "0", request.finish_reason)
        reasons[request.finish_reason].inc()

    # ------------------------------------------------------------------ read by the HTTP thread

    def render(self) -> tuple[bytes, str]:
        """The exposition for ``GET /metrics``: (body, content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def names(self) -> dict[str, str]:
        """Every ``labsupport:`` metric family this object exposes (the process's own aside), name (as
        constructed: counters without ``_total``) -> type (``gauge``, ``counter``, ``histogram``)."""
        return {f.name: f.type for f in self.registry.collect() if f.name.startswith(PREFIX)}
