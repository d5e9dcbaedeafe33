"""Speculative decoding (chapter 09): guess k tokens cheaply, let the model check them all in one pass.

A decode step of a small batch is bound by reading the weights, not by arithmetic: feeding 1 + k
tokens of a sequence costs about what feeding 1 costs. So a *proposer* guesses the next k tokens,
the step feeds the last real token and the k guesses through the paged KV cache, and the target
model's logits at those 1 + k positions say, in one pass, how many guesses it agrees with. Every
step still emits at least one token (the target's own at the first disagreement, or a bonus
token after the last guess), so a bad guesser costs time, never correctness.

Two proposers, with vLLM's option shape (``speculative_config``):

* ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}``:
  prompt lookup. Find the last n (then n-1 ... m) tokens earlier in the sequence and propose what
  followed them there. No second model; it shines where output copies input (code edits,
  extraction, summaries quoting their source).
* ``{"method": "draft_model", "model": ..., "num_speculative_tokens": k}``: a small model of the same
  vocabulary runs k cheap decode steps. Its KV lives in its own pool, in the *same block ids* as the
  target's, so one block table serves both.

``rejection_sample`` is the acceptance rule (Leviathan et al. 2023; Chen et al. 2023): accept draft
d with probability min(1, p(d) / q(d)); at the first rejection draw from the residual
max(p - q, 0), renormalised. What comes out is distributed exactly as the target's own samples,
whatever the draft. Greedy is the case p = one-hot(argmax): a guess survives iff it is the argmax,
so greedy output is token for token that of plain decoding. The rule is chapter 09's exercise.
"""
from __future__ import annotations

import torch

from .sampler import seeded_generator

METHODS = ("ngram", "draft_model")


def check_speculative_config(spec: dict) -> dict:
    """Validate vLLM's ``speculative_config`` dict and fill its defaults; raise ValueError saying what to fix."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {spec!r}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
    if set(spec) - known:
        raise ValueError(f"speculative_config has unknown keys {sorted(set(spec) - known)}; known: {sorted(known)}")
    method = spec.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {METHODS}, got {method!r}")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
        raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
    out = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        hi, lo = spec.get("prompt_lookup_max"), spec.get("prompt_lookup_min")
        if hi is None and lo is None:  # vLLM's defaults: 5 and 5; one given, the other equals it
            hi = lo = 5
        hi, lo = (lo if hi is None else hi), (hi if lo is None else lo)
        for name, v in (("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}")
        out |= {"prompt_lookup_max": hi, "prompt_lookup_min": lo}
    elif spec.get("model") is None:
        raise ValueError("method 'draft_model' needs speculative_config['model']: a smaller model of the same vocabulary")
    else:
        out["model"] = spec["model"]
    return out


def ngram_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the (up to) k tokens that followed the earliest earlier occurrence of the
    sequence's last n tokens, for the longest n in [min_n, max_n] that occurs; [] when none does.

    vLLM's rule (its ``NgramProposer``), so both engines guess the same tokens from the same text.
    A plain scan: a sequence of a few thousand tokens takes well under a millisecond per n."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        tail = token_ids[-n:]
        for start in range(len(token_ids) - n):  # not the tail itself
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """The acceptance rule. ``target_probs`` [s + 1, vocab]: the target's distribution at each verified
    position (row j follows the real tokens and drafts 1..j); ``draft_token_ids``: the s guesses;
    ``draft_probs`` [s, vocab]: the distribution each guess was drawn from, or None when the guesses are
    deterministic (prompt lookup, a greedy draft: q is one-hot). Returns the emitted tokens: the
    accepted guesses, then one token from the target (the residual's draw, or the bonus row's)."""
    emitted = []
    for j, d in enumerate(draft_token_ids):
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if q_d > 0 and u < float(p[d]) / q_d:  # accept with probability min(1, p(d) / q(d))
            emitted.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0  # max(p - one_hot(d), 0)
        else:
            residual = (p - draft_probs[j]).clamp_(min=0)
        if float(residual.sum()) <= 0:  # only by rounding: p and q agree everywhere
            residual = p
        emitted.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return emitted
    bonus = target_probs[len(draft_token_ids)]  # every guess survived: one more token for free
    emitted.append(int(torch.multinomial(bonus, 1, generator=generator)))
    return emitted


def max_drafts(req, k: int, longest: int) -> int:
    """Guesses worth making for ``req``: at most k, and never past ``max_tokens`` or the context
    (the step emits accepted guesses plus one token)."""
    return max(0, min(k, req.params.max_tokens - len(req.output_token_ids) - 1, longest - req.num_tokens - 1))


class _DraftView:
    """What the draft's attention backend needs of a request: its blocks and the draft's own progress."""

    def __init__(self, req, num_computed: int):
        self.request_id, self.block_table, self.num_computed_tokens = req.request_id, req.block_table, num_computed


class DraftModelProposer:
    """A small model guessing k tokens, one cheap decode step each, with its KV in its own pool.

    Its pool has the target pool's block ids (same ``num_blocks`` and ``block_size``), so a request's
    block table addresses both; the draft keeps its own count of the tokens it has seen
    (``req.spec.num_draft_computed``) and catches up on the accepted ones at the next proposal."""

    def __init__(self, model, backend, sampler):
        self.model, self.backend, self.sampler = model, backend, sampler
        self.generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def propose(self, requests: list, ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """One guess list per request (k_i guesses each; the request's blocks must hold them) and the
        distributions they were drawn from (None for a greedy request: its guesses are argmax)."""
        dev = next(self.model.parameters()).device
        drafts = [[] for _ in requests]
        probs = [[] for _ in requests]
        views = [_DraftView(r, r.spec.num_draft_computed) for r in requests]
        feeds = [r.all_token_ids[v.num_computed_tokens:] for r, v in zip(requests, views)]
        active = [i for i, k in enumerate(ks) if k > 0]
        for step in range(max(ks, default=0)):
            if step > 0:
                active = [i for i in active if ks[i] > step]
                feeds = [[drafts[i][-1]] if i in active else [] for i in range(len(requests))]
            if not active:
                break
            rows = [views[i] for i in active]
            n = [len(feeds[i]) for i in active]
            ids = torch.tensor([t for i in active for t in feeds[i]], device=dev)
            pos = torch.tensor([p for v, m in zip(rows, n) for p in range(v.num_computed_tokens,
                                                                         v.num_computed_tokens + m)], device=dev)
            meta = self.backend.prepare(rows, n)
            hidden = self.model(ids, pos, self.backend, meta)
            logits = self.model.logits(hidden[torch.tensor(meta.query_offsets[1:], device=dev) - 1])
            for row, i in enumerate(active):
                req, view = requests[i], views[i]
                view.num_computed_tokens += n[row]
                if req.params.greedy:
                    drafts[i].append(int(logits[row].argmax()))
                else:
                    q = self.sampler.probs(logits[row], req)
                    drafts[i].append(int(torch.multinomial(q, 1, generator=self._generator(req, q.device))))
                    probs[i].append(q)
        for req, k in zip(requests, ks):
            if k > 0:
                # the draft model's own progress, which only it knows; positions past it hold guesses' KV,
                # rewritten next time
                req.spec.num_draft_computed = req.num_tokens
        return [(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _generator(self, req, device) -> torch.Generator | None:
        """The draft's own seeded stream: the target's draws stay where a seed puts them."""
        return seeded_generator(self.generators, req, device, salt=0x5EED)

    def release(self, req):
        self.generators.pop(req.request_id, None)


class Speculator:
    """After each step, the next guesses of every request that just got a token and still runs.

    A guess needs room: prompt lookup's are reserved by the scheduler like any token (and dropped
    first when memory is short); a draft model writes its guesses' K/V before the step that verifies
    them, so their blocks are reserved here, and a request the pool cannot hold them for guesses nothing."""

    def __init__(self, spec: dict, kv, draft: DraftModelProposer | None = None):
        self.spec, self.kv, self.draft = spec, kv, draft

    def propose(self, requests: list, longest: int):
        k, spec = self.spec["num_speculative_tokens"], self.spec
        ks = [max_drafts(req, k, longest) for req in requests]
        if self.draft is None:
            for req, ki in zip(requests, ks):
                req.spec.propose(ngram_propose(req.all_token_ids, ki, spec["prompt_lookup_min"],
                                               spec["prompt_lookup_max"]) if ki else [])
            return
        for i, req in enumerate(requests):
            if ks[i] and not self.kv.can_allocate(req, 1 + ks[i]):
                ks[i] = 0
            if ks[i]:
                self.kv.allocate(req, 1 + ks[i])
        for req, (guesses, probs) in zip(requests, self.draft.propose(requests, ks)):
            req.spec.propose(guesses, probs)

    def release(self, req):
        if self.draft is not None:
            self.draft.release(req)


def spec_counters(k: int) -> dict:
    """vLLM's spec-decode counters, as ``llm.stats()`` and ``/metrics`` show them.
    Mean acceptance length = 1 + accepted / drafts."""
    return {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0, "spec_decode_num_accepted_tokens": 0,
            "spec_decode_num_accepted_tokens_per_pos": [0] * k}


def count_verification(counters: dict, num_drafts: int, num_accepted: int):
    """One sequence's verified guesses: ``num_drafts`` fed, the first ``num_accepted`` of them accepted."""
    if num_drafts == 0:
        return
    counters["spec_decode_num_drafts"] += 1
    counters["spec_decode_num_draft_tokens"] += num_drafts
    counters["spec_decode_num_accepted_tokens"] += num_accepted
    for pos in range(num_accepted):
        counters["spec_decode_num_accepted_tokens_per_pos"][pos] += 1
