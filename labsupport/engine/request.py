"""A request's life: what was asked (SamplingParams), where it is (Request), what came out.

The engine tracks one number per request that drives everything else, as vLLM's v1 engine
does: ``num_computed_tokens``, how many of the request's tokens already have K/V in the
cache. Whatever is not yet computed is fed to the next forward pass. Without a cache that
number stays 0, so every step feeds the whole sequence again.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import numbers
import time
from dataclasses import dataclass, field

from .logits_processors import check_logit_bias, check_penalties
from .stopping import streamable
from .structured_output import normalize as normalize_structured_outputs


_INT64 = (-(1 << 63), (1 << 63) - 1)  # a seed is a signed 64-bit integer, as torch and vLLM take it
MAX_LOGPROBS = 20  # the most alternatives per position, as OpenAI's top_logprobs allows
MAX_SAMPLES = 256  # the most parallel samples (n) of one prompt


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)  # numpy integers too, not True


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """vLLM's names and defaults for the parameters the course uses.

    Every field is checked here, when the request is made, because a bad value found later, in
    the sampler, in the middle of a step, would fail every request sharing that step: NaN, inf,
    a seed wider than 64 bits or a stop string of the wrong type raises ``ValueError`` now, with
    what to change.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    top_k: int = -1  # keep only the k most likely tokens before drawing; -1 or 0: off
    min_tokens: int = 0  # this many tokens at least before EOS or a stop_token_id may be drawn
    stop_token_ids: list[int] | None = None  # these tokens end the request too (finish reason "stop")
    logprobs: int | None = None  # per output token: its logprob and the top-k's (k in [0, 20]); None: none
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    kv_transfer_params: dict | None = None  # PD (chapter 07): do_remote_decode / do_remote_prefill and where
    n: int = 1  # parallel samples of one prompt (chapter 03): forked after the prompt, blocks copied on write
    # chapter 06's API: rules on the logits before sampling (logits_processors.py, structured_output.py)
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often the token is in the output
    repetition_penalty: float = 1.0  # vLLM's: tokens of the prompt or output divided (> 0) / multiplied by it
    logit_bias: dict[int, float] | None = None  # {token id: bias in [-100, 100]} added to the logits
    structured_outputs: dict | None = None  # {"json": schema} | {"json_object": True} | {"regex": ...} | ...

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be a positive integer (0 only with prompt_logprobs set: score the "
                             f"prompt and generate nothing), got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:  # NaN fails the comparison too
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64[0] <= self.seed <= _INT64[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1] or None, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.stop = list(stop)
        self.max_tokens, self.temperature, self.top_p = int(self.max_tokens), float(self.temperature), float(self.top_p)
        self.seed = None if self.seed is None else int(self.seed)
        self._check_token_options()

    def _check_token_options(self):
        """The options of chapter 06's API (vLLM's names and rules), normalized to plain ints and lists."""
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or 1 <= self.top_k <= _INT64[1]):
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and 0 <= t <= _INT64[1] for t in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0) or None, "
                             f"got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (how many of the "
                                 f"most likely tokens to return besides the chosen one), got {k!r}")
            setattr(self, name, None if k is None else int(k))
        self.top_k, self.min_tokens, self.stop_token_ids = int(self.top_k), int(self.min_tokens), [int(t) for t in ids]
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be a dict or None, got {self.kv_transfer_params!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}] (samples of the prompt), got {self.n!r}")
        self.n = int(self.n)
        if self.seed is not None and self.seed + self.n - 1 > _INT64[1]:
            raise ValueError(f"seed + n - 1 must fit in 64 bits (sample i is drawn with seed + i), got seed={self.seed}")
        if self.max_tokens == 0 and self.n > 1:
            raise ValueError("max_tokens=0 scores the prompt only: n > 1 would give n copies of the same scores")
        self.presence_penalty, self.frequency_penalty, self.repetition_penalty = check_penalties(
            self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        self.logit_bias = check_logit_bias(self.logit_bias)
        self.structured_outputs = normalize_structured_outputs(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_sample(self, index: int) -> "SamplingParams":
        """The parameters of sample ``index`` of ``n``: one sample, drawn with seed ``seed + index`` (vLLM's
        rule for parallel sampling: each sample's generator starts from the seed and its index), so seeded
        samples are reproducible, differ from one another, and each equals a request alone with that seed."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + index)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # PD: its prompt's KV is on its way from another engine
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Times (the engine's clock: ``time.perf_counter`` unless simulated), the latencies and the preemptions a
    serving engineer reads."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0  # times its KV was freed to make room, and recomputed later
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (or CPU tier) at its first admission

    @property
    def queueing_time(self) -> float | None:
        """Time spent waiting before the first forward pass that included the request."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: queueing + prefill + one sample."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (the mean inter-token latency)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies, one per token after the first."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


_ids = itertools.count()


def next_request_id() -> str:
    return str(next(_ids))


def sample_request_id(request_id: str, index: int) -> str:
    """The id of sample ``index`` of an ``n > 1`` request: the request's own for sample 0, ``index_requestid``
    (vLLM's form) for the others. The server's choices are keyed by it."""
    return request_id if index == 0 else f"{index}_{request_id}"


@dataclass
class KVBlocks:
    """Where a request's KV lives in the paged pool. The KV manager (``kv_cache_manager.py``) owns it: it alone
    writes it (allocating, sharing a cached prefix, forking, freeing); the scheduler, the attention backend and
    the chapters only read it (``req.block_table``)."""

    cache_salt: str | None = None  # tenant: requests with different salts share no cached KV
    block_table: list[int] = field(default_factory=list)  # the pool blocks holding this request's tokens
    block_hashes: list[bytes] = field(default_factory=list)  # prefix cache: chained hashes of its full blocks
    num_host_cached_tokens: int = 0  # of the prompt tokens reused when first admitted, those from the CPU tier


@dataclass
class SpecState:
    """Speculative decoding (chapter 09): the guesses the next step verifies, the distributions a draft model
    drew them from (None: deterministic guesses), and the tokens whose K/V the draft model holds. The
    speculator proposes (``propose``); the scheduler drops guesses that were verified or do not fit (``drop``)."""

    token_ids: list[int] = field(default_factory=list)
    draft_probs: object = None  # a [len(token_ids), vocab] tensor, or None
    num_draft_computed: int = 0

    def propose(self, token_ids: list[int], draft_probs=None):
        self.token_ids, self.draft_probs = token_ids, draft_probs

    def drop(self):
        self.token_ids, self.draft_probs = [], None


@dataclass
class RemoteKV:
    """Prefill/decode disaggregation (chapter 07): KV computed by another engine, or kept for one."""

    transfer_params: dict | None = None  # where the next engine fetches this request's KV (set when it finishes)
    load_done: bool = False  # its remote KV arrived (or failed and is recomputed): load no more
    num_external_tokens: int = 0  # prompt tokens whose KV another engine computed (part of num_cached_tokens)


@dataclass
class Logprobs:
    """Chapter 06's outputs, recorded by ``update_from_output`` from what the runner computed."""

    output: list[dict[int, float]] = field(default_factory=list)  # per output token, if params.logprobs is set
    prompt: list[dict[int, float] | None] | None = None  # per prompt token, if params.prompt_logprobs is set


class Request:
    """One request's state. Its own fields are what every request has; each chapter's feature keeps its state
    in one small part (``kv``, ``spec``, ``remote_kv``, ``logprobs``). The scheduler's bookkeeping half
    (``lifecycle.py``) writes it as the request moves; the KV manager writes the ``kv`` part."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                 prompt: str | None = None, cache_salt: str | None = None, eos_token_ids=(), priority: int = 0,
                 arrival_time: float | None = None):
        self.request_id = request_id if request_id is not None else next_request_id()
        self.priority = priority  # scheduling_policy="priority": smaller first (vLLM's Request.priority)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""  # the output so far, detokenized incrementally by the engine
        # the engine's clock gives it (a simulation's is virtual); a request made by hand arrives now
        self.metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self.num_new_output_tokens = 0  # tokens the last step gave it (more than 1 with accepted guesses)
        # the tokens min_tokens keeps from being drawn: stop_token_ids, and EOS unless ignore_eos
        self.all_stop_token_ids: set[int] = set(params.stop_token_ids or ()) | (
            set() if params.ignore_eos else set(eos_token_ids))
        self.samples: list[Request] = []  # n > 1: the other samples, forked from this one after its prompt
        self.kv = KVBlocks(cache_salt)
        self.spec = SpecState()
        self.remote_kv = RemoteKV()
        # chapter 06: the first prompt token has nothing before it, so its prompt logprobs are None
        self.logprobs = Logprobs(prompt=None if params.prompt_logprobs is None else [None])

    @property
    def block_table(self) -> list[int]:
        """The pool blocks holding this request's tokens (read-only here: the KV manager writes ``kv``)."""
        return self.kv.block_table

    @property
    def num_preemptions(self) -> int:
        return self.metrics.num_preemptions

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy: n until it has forked, then 1 (each sample is its own)."""
        return self.params.n if self.params.n > 1 and not self.samples else 1

    def fork(self, index: int) -> "Request":
        """Sample ``index`` of an ``n > 1`` request: the same prompt, its own seed (``seed + index``, as
        vLLM does, or every sample would be the same draw: ``SamplingParams.for_sample``) and id
        (``sample_request_id``). The caller gives it the prompt's KV (shared blocks) and puts it in the
        batch. The prompt's logprobs, computed once, are the sample's too (an echoing choice shows them)."""
        child = Request(self.prompt_token_ids, self.params.for_sample(index), sample_request_id(self.request_id, index),
                        self.prompt, self.kv.cache_salt, priority=self.priority)
        child.all_stop_token_ids = set(self.all_stop_token_ids)
        if self.logprobs.prompt is not None:
            child.logprobs.prompt = list(self.logprobs.prompt)
        child.metrics.arrival_time = self.metrics.arrival_time
        child.metrics.first_scheduled_time = self.metrics.first_scheduled_time
        return child

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def streamable_text(self) -> str:
        """The text a client may be sent already (``stopping.streamable``: a possible stop string held back)."""
        return streamable(self.text, self.params.stop, self.is_finished)

    def __repr__(self):
        return (f"Request({self.request_id}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})")


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt (flattened from vLLM's ``outputs[0]``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    cached: bool = False  # served from the result cache, without running the model
    logprobs: list[dict[int, float]] | None = None  # per token {id: logprob}: the chosen one and the top-k
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token; the first is None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (or another engine)
    kv_transfer_params: dict | None = None  # PD: a prefill worker's answer says where its KV waits
    samples: list["RequestOutput"] = field(default_factory=list)  # n > 1: samples 1 .. n-1 (this is sample 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def copy(self, **changes) -> "RequestOutput":
        """An independent copy (lists and dicts copied): what a cache stores and hands out."""
        def dicts(rows):
            return None if rows is None else [None if d is None else dict(d) for d in rows]
        copied = dict(prompt_token_ids=list(self.prompt_token_ids), token_ids=list(self.token_ids),
                      logprobs=dicts(self.logprobs), prompt_logprobs=dicts(self.prompt_logprobs))
        return dataclasses.replace(self, **{**copied, **changes})

    @property
    def outputs(self):
        """vLLM shape: ``out.outputs[i].text``, one per sample (``n``), works as in vLLM."""
        return [self, *self.samples]

    @property
    def ttft(self):
        return self.metrics.ttft

    @property
    def tpot(self):
        return self.metrics.tpot

    def __repr__(self):
        return (f"RequestOutput(id={self.request_id}, text={self.text!r}, "
                f"tokens={len(self.token_ids)}, finish_reason={self.finish_reason})")
