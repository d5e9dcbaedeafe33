"""Routing: which workers may get the next request (``Workers``: the healthy ones of the role
needed) and which one does (the policies).

Each policy is a small class with one decision, ``choose(candidates, body) -> url``, made over
the workers that are healthy right now, and the bookkeeping every policy shares: ``choose``
counts the request as in flight on the worker it picked, ``done(url)`` ends it. "In flight" is
what *this router* sent and has not finished (the worker's own queue is invisible from here,
and polling it would be stale by the time a request lands; what we sent ourselves is exact).

* ``RoundRobin``: each worker in turn. Fair when requests cost the same; the prefill side of
  PD disaggregation uses it (a prefill is one forward pass over the prompt, quick and alike).
* ``LeastLoaded``: the worker with the fewest requests in flight, ties in turn. Adapts when
  some requests are long: a worker stuck with three 2,000-token answers stops getting new
  work until they end, where round robin would keep piling on. The decode side uses it.
* ``PrefixAware``: requests whose prompts start alike go to the same worker, so the KV blocks
  of their shared prefix (a system prompt, a long document, the conversation so far) stay hot
  in *that* worker's prefix cache (chapter 03) and each new request computes only its tail.
  Spread over N workers by round robin, every worker would compute the same prefix and the
  hit rate would fall to about 1/N. Stickiness must not starve the others, hence the bound:
  when the sticky worker has ``max_imbalance`` more requests in flight than the least loaded
  one, the request goes to the least loaded (which then warms its own cache).
* ``SLOAware``: the request goes where it can still get its first token within a TTFT target,
  or nowhere (``Shed``: the router answers 429 at once). Round robin and least loaded count
  requests, but a 2,000-token prompt costs a worker as much prefill as forty 50-token ones, and
  a request that will miss its target anyway still delays every request queued behind it. The
  decision itself, ``choose_worker(prompt_tokens, loads, slo_ttft_s) -> url | None``, is the
  attendee's in chapter 08; this class keeps the state it needs (``WorkerLoad``).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)
POLICIES = ("round_robin", "least_loaded", "prefix_aware")


class Policy:
    """In-flight counting shared by all policies; subclasses implement ``pick``."""

    def __init__(self):
        self.in_flight: Counter[str] = Counter()
        self.turn = 0  # round-robin cursor (also breaks ties)

    def choose(self, candidates: list[str], body: dict) -> str:
        """The worker for this request, counted as in flight on it until ``done(url)``."""
        if not candidates:
            raise ValueError("no candidate worker")
        url = self.pick(list(candidates), body)
        self.in_flight[url] += 1
        return url

    def done(self, url: str):
        self.in_flight[url] -= 1

    def pick(self, candidates: list[str], body: dict) -> str:
        raise NotImplementedError

    def next_in_turn(self, candidates: list[str]) -> str:
        url = candidates[self.turn % len(candidates)]
        self.turn += 1
        return url

    def least_loaded(self, candidates: list[str]) -> str:
        low = min(self.in_flight[u] for u in candidates)
        return self.next_in_turn([u for u in candidates if self.in_flight[u] == low])


class RoundRobin(Policy):
    def pick(self, candidates, body):
        return self.next_in_turn(candidates)


class LeastLoaded(Policy):
    def pick(self, candidates, body):
        return self.least_loaded(candidates)


class PrefixAware(Policy):
    """Sticky by the hash of the prompt's first ``prefix_chars`` characters (a bounded LRU table)."""

    def __init__(self, prefix_chars: int = 256, max_imbalance: int = 4, table_size: int = 10_000):
        super().__init__()
        self.prefix_chars, self.max_imbalance, self.table_size = prefix_chars, max_imbalance, table_size
        self.table: OrderedDict[str, str] = OrderedDict()  # prefix hash -> the worker that last got it

    def pick(self, candidates, body):
        key = prefix_key(body, self.prefix_chars)
        low = min(self.in_flight[u] for u in candidates)
        url = self.table.get(key)
        if url not in candidates or self.in_flight[url] - low > self.max_imbalance:
            url = self.least_loaded(candidates)  # a new prefix, a worker gone, or the sticky one overloaded
        self.table[key] = url
        self.table.move_to_end(key)
        while len(self.table) > self.table_size:
            self.table.popitem(last=False)
        return url


class Shed(Exception):
    """The policy refuses the request: no worker can serve it within its target (the router answers 429)."""


@dataclass(frozen=True)
class WorkerLoad:
    """What the router knows of one worker when a request arrives: what *it* sent there and has not seen
    end (exact, unlike a polled queue length), and how fast the worker works through prompt tokens."""
    url: str
    queued_tokens: int  # prompt tokens of the requests this router sent to the worker that have not ended
    in_flight: int  # those requests
    s_per_token: float  # seconds per prompt token it sustains (chapter 08 measures it with every worker busy)


class SLOAware(Policy):
    """``choose_worker(prompt_tokens, loads, slo_ttft_s)`` over the candidates' ``WorkerLoad``; ``None`` sheds.

    Queued tokens are booked when a request is sent and released when one ends. ``done(url)`` does
    not say which request ended, so the oldest one's tokens are released: requests of equal answer
    lengths end roughly in the order they were sent, and an error here only shifts which tokens wait."""

    def __init__(self, choose_worker: Callable, slo_ttft_s: float, s_per_token: dict[str, float]):
        super().__init__()
        self.choose_worker, self.slo_ttft_s, self.s_per_token = choose_worker, slo_ttft_s, dict(s_per_token)
        self.queued: dict[str, deque] = {}
        self.shed = 0

    def loads(self, candidates: list[str]) -> list[WorkerLoad]:
        return [WorkerLoad(u, sum(self.queued.get(u, ())), self.in_flight[u], self.s_per_token[u]) for u in candidates]

    def pick(self, candidates, body):
        n = prompt_tokens(body)
        url = self.choose_worker(n, self.loads(candidates), self.slo_ttft_s)
        if url is None:
            self.shed += 1
            raise Shed(f"no worker can start this {n}-token prompt within the TTFT target of "
                       f"{self.slo_ttft_s * 1000:.0f} ms")
        if url not in candidates:
            raise ValueError(f"choose_worker returned {url!r}, not one of the healthy workers {candidates}")
        self.queued.setdefault(url, deque()).append(n)
        return url

    def done(self, url: str):
        super().done(url)
        if self.queued.get(url):
            self.queued[url].popleft()


def prompt_tokens(body: dict) -> int:
    """The prompt's length in tokens: exact for token ids; for text, about 4 characters a token (the
    router has no tokenizer; an estimate is enough to rank workers)."""
    prompt = body.get("prompt") if "messages" not in body else None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    return max(1, len(prompt_text(body)) // 4)


def prompt_text(body: dict) -> str:
    """The text a request starts with: chat, its messages' contents concatenated; completions, the
    prompt string, or its token ids written out (a batch of prompts: the first one)."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: their text
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(content if isinstance(content, str) else "")
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def prefix_key(body: dict, prefix_chars: int) -> str:
    """A stable hash of the prompt's first ``prefix_chars`` characters (stable across processes,
    unlike ``hash()``, so two routers agree and a notebook can print it)."""
    return hashlib.blake2b(prompt_text(body)[:prefix_chars].encode(), digest_size=8).hexdigest()


def make_policy(name: str | Policy, prefix_chars: int = 256, max_imbalance: int = 4) -> Policy:
    """The policy called ``name``; a ``Policy`` object (one the command line cannot name, as ``SLOAware`` with
    the attendee's function) is used as it is."""
    if isinstance(name, Policy):
        return name
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware(prefix_chars, max_imbalance)
    raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")


@dataclass
class Worker:
    url: str
    roles: list[str] = field(default_factory=list)
    healthy: bool | None = None  # None: not probed yet (the router probes all before it takes requests)


class Workers:
    """Who may get a request: each role's workers with their health, and the role's policy (who does).

    PD mode has two roles, prefill (round robin: prefills are alike) and decode (least loaded: decodes
    last as long as their answers); instance mode has one, with the policy asked for. A worker is
    healthy while its ``GET /health`` answers 200 (``probe_all``, every ``health_interval`` seconds) and
    until one of its requests fails (the router calls ``set_healthy(url, False)``): a dead worker is
    skipped, a restarted one comes back at the next probe."""

    def __init__(self, prefill=(), decode=(), instances=(), policy="round_robin", prefix_chars=256,
                 max_imbalance=4):
        if bool(instances) == bool(prefill or decode) or (not instances and not (prefill and decode)):
            raise ValueError("give either --instances, or both --prefill and --decode")
        self.pools: dict[str, tuple[list[str], Policy]] = (
            {"instance": (list(instances), make_policy(policy, prefix_chars, max_imbalance))} if instances
            else {"prefill": (list(prefill), RoundRobin()), "decode": (list(decode), LeastLoaded())})
        self.by_url: dict[str, Worker] = {}
        for role, (urls, _) in self.pools.items():
            if len(set(urls)) != len(urls):
                raise ValueError(f"a {role} worker is listed twice: {urls}")
            for url in urls:
                self.by_url.setdefault(url, Worker(url)).roles.append(role)

    def candidates(self, role: str, exclude=()) -> list[str]:
        return [u for u in self.pools[role][0] if self.by_url[u].healthy and u not in exclude]

    def set_healthy(self, url: str, ok: bool, why: str = "") -> bool:
        """Record a probe's or a request's verdict; True if the worker just went down."""
        worker = self.by_url[url]
        if ok != worker.healthy and (worker.healthy is not None or not ok):
            log.warning("worker %s is %s%s", url, "back" if ok else "down", f" ({why})" if why else "")
        went_down = worker.healthy is not False and not ok
        worker.healthy = ok
        return went_down

    async def probe_all(self, client, timeout: float = 1.0) -> list[str]:
        """Probe every worker's ``/health`` at once (``client``: an ``httpx.AsyncClient``); the urls that just
        went down."""
        async def probe(url):
            try:
                ok = (await client.get(url + "/health", timeout=timeout)).status_code == 200
            except Exception:  # refused, reset, timed out: all mean "not now"
                ok = False
            return url if self.set_healthy(url, ok, "" if ok else "failed a health probe") else None

        return [u for u in await asyncio.gather(*(probe(url) for url in self.by_url)) if u]

    def missing_roles(self) -> list[str]:
        return [role for role in self.pools if not self.candidates(role)]

    def table(self) -> dict:
        return {w.url: {"role": "+".join(w.roles), "healthy": bool(w.healthy)} for w in self.by_url.values()}
