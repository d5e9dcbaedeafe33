"""Turn the last position's logits into the next token (and, when asked, its logprobs).

Greedy (temperature 0) is argmax, which is what makes our tokens comparable with
``transformers`` token for token. Otherwise: temperature, then top-k, then nucleus (top-p)
filtering (vLLM's order), then a draw from a per-request generator, so a fixed ``seed`` gives
the same text no matter which other requests share the batch.

Rules come before either, in vLLM's order: a structured-output grammar masks the tokens it does
not allow (``structured_output.py``); a request that has not yet produced ``min_tokens`` tokens
cannot draw EOS or one of its ``stop_token_ids`` (their logits become -inf, as vLLM's min-tokens
processor does, unless the grammar allows nothing else); then ``logit_bias`` and the repetition,
frequency and presence penalties (``logits_processors.py``). Logprobs are those of the *raw*
logits, before the sampling rules (vLLM's default ``raw_logprobs``): what the model thinks, not
what the rules left of it; only the grammar's mask comes first, as in vLLM, where it is applied
to the logits before the sampler sees them.
"""
from __future__ import annotations

import torch

from .logits_processors import Penalties, apply_logit_bias, has_penalties
from .outputs import ModelRunnerOutput
from .stopping import may_stop
from .request import Request


def option(req, name: str, default=None):
    """A sampling option of ``req``; benchmarks pass bare request stand-ins whose params have only ``greedy``."""
    return getattr(req.params, name, default)


def logprob_dicts(logprobs: torch.Tensor, chosen: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Rows of log-probabilities [n, vocab] -> per row ``{chosen: lp, top-k ids: lps}``, the chosen
    token first, then the k most likely in order (vLLM's layout). One gather, one topk, two copies
    to the host, whatever the number of rows."""
    index = torch.tensor(chosen, device=logprobs.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, index).squeeze(1).tolist()
    k = max(ks)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [{c: lp, **dict(zip(ids[:k_row], lps[:k_row]))}
            for c, lp, ids, lps, k_row in zip(chosen, chosen_lp, top_ids, top_lp, ks)]


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}
        self.penalties = Penalties()  # per request: output token counts, prompt token set
        self.structured = None  # StructuredOutputs, set by the engine (it needs the tokenizer)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               num_new_tokens: list[int] | None = None) -> ModelRunnerOutput:
        """logits: [num_requests, vocab] -> one token id per request, with logprobs where asked.

        ``num_new_tokens`` (tokens each request fed this step) tells which requests are still inside
        their prompt (a chunk that is not the last): their token is thrown away, so they get argmax
        and no draw, since a draw would move a seeded generator by a number of steps that depends on
        how the prompt happened to be chunked, and the same seed would give another text.
        """
        fed = num_new_tokens or [None] * len(requests)
        kept = [(n is None or req.num_computed_tokens + n >= len(req.all_token_ids)) and option(req, "max_tokens", 1) > 0
                for req, n in zip(requests, fed)]  # max_tokens=0: the prompt is scored, no token is kept
        if self.structured is not None:
            logits = self.structured.mask(logits, requests, kept)
        raw = logits
        logits = self._hold_back_stop_tokens(logits, requests)
        logits = self._bias_and_penalize(logits, raw, requests, kept)
        tokens = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(requests):
            if kept[i] and not req.params.greedy:
                tokens[i] = self._draw(logits[i], req)
        if self.structured is not None:
            self.structured.accept(requests, tokens, kept)
        asked = [req if k else None for req, k in zip(requests, kept)]
        return ModelRunnerOutput(tokens, self._logprobs(raw, asked, tokens))

    def _bias_and_penalize(self, logits: torch.Tensor, raw: torch.Tensor, requests: list[Request],
                           kept: list[bool]) -> torch.Tensor:
        """logit_bias, then the penalties (vLLM's order), on a float32 copy of the kept rows that have them."""
        biased = [i for i, req in enumerate(requests) if kept[i] and option(req, "logit_bias")]
        penalized = [i for i, req in enumerate(requests) if kept[i] and has_penalties(req.params)]
        if not biased and not penalized:
            return logits
        if logits is raw or logits.dtype != torch.float32:  # the raw logits stay as they are (logprobs)
            logits = logits.to(torch.float32, copy=True)
        apply_logit_bias(logits, biased, requests)
        self.penalties.apply(logits, penalized, requests)
        return logits

    @staticmethod
    def _hold_back_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """min_tokens: EOS and the stop token ids get -inf until the request has that many tokens; a row
        the grammar left nothing else in keeps them (vLLM restores them so: a finished grammar must stop)."""
        rows = [(i, [t for t in req.all_stop_token_ids if t < logits.shape[-1]]) for i, req in enumerate(requests)
                if not may_stop(len(getattr(req, "output_token_ids", ())) + 1, option(req, "min_tokens", 0))]
        if not any(ids for _, ids in rows):
            return logits
        held = logits.clone()  # the raw logits stay as they are: logprobs are computed from them
        for i, ids in rows:
            held[i, ids] = float("-inf")
            if option(requests[i], "structured_outputs") is not None and torch.isneginf(held[i]).all():
                held[i] = logits[i]
        return held

    @staticmethod
    def _logprobs(logits: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[dict | None]:
        """One batched log-softmax over the rows that asked (nothing is computed when none did).
        ``requests`` has None for rows whose token is thrown away."""
        ks = [None if req is None else option(req, "logprobs") for req in requests]
        rows = [i for i, k in enumerate(ks) if k is not None]
        if not rows:
            return [None] * len(requests)
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        found = logprob_dicts(logprobs, [tokens[i] for i in rows], [ks[i] for i in rows])
        out = [None] * len(requests)
        for i, d in zip(rows, found):
            out[i] = d
        return out

    def verify(self, logits: torch.Tensor, req: Request, draft_token_ids: list[int],
               draft_probs: torch.Tensor | None, rule) -> tuple[list[int], list[dict] | None]:
        """Speculative decoding (chapter 09): the target's logits at the 1 + s verified positions
        [s + 1, vocab] -> the emitted tokens (``rule``: the acceptance rule, ``spec_decode.rejection_sample``
        or an attendee's) and, if the request asked, each one's logprobs from the raw logits.

        Each row gets the rules a plain step would give it: ``min_tokens`` counts the tokens before
        that row, and greedy is the one-hot distribution at the argmax, so a guess survives iff it is
        the token plain greedy decoding would have chosen."""
        done = len(req.output_token_ids)
        rows = logits
        if not may_stop(done + 1, option(req, "min_tokens", 0)):
            held = [t for t in req.all_stop_token_ids if t < logits.shape[-1]]
            rows = logits.clone()
            for j in range(rows.shape[0]):
                if not may_stop(done + j + 1, req.params.min_tokens):
                    rows[j, held] = float("-inf")
        if req.params.greedy:
            target = torch.nn.functional.one_hot(rows.argmax(dim=-1), rows.shape[-1]).to(torch.float32)
        else:
            target = torch.stack([self.probs(row, req) for row in rows])
        emitted = [int(t) for t in rule(target, draft_token_ids, draft_probs, self._generator(req, logits.device))]
        k = option(req, "logprobs")
        if k is None:
            return emitted, None
        return emitted, logprob_dicts(torch.log_softmax(logits[:len(emitted)].float(), dim=-1), emitted,
                                      [k] * len(emitted))

    def probs(self, logits: torch.Tensor, req: Request) -> torch.Tensor:
        """The distribution a sampled (temperature > 0) request draws from: temperature, top-k, top-p."""
        logits = logits / req.params.temperature
        if 0 < req.params.top_k < logits.shape[-1]:
            kth = logits.topk(req.params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th stay, as in vLLM
        probs = torch.softmax(logits, dim=-1)
        if req.params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (always at least the top token)
            drop = sorted_p.cumsum(-1) - sorted_p > req.params.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p / sorted_p.sum())
        return probs

    def _draw(self, logits: torch.Tensor, req: Request) -> int:
        probs = self.probs(logits, req)
        return int(torch.multinomial(probs, 1, generator=self._generator(req, probs.device)))

    def _generator(self, req: Request, device) -> torch.Generator | None:
        return seeded_generator(self.generators, req, device)

    def release(self, req: Request):
        self.generators.pop(req.request_id, None)
        self.penalties.release(req.request_id)
        if self.structured is not None:
            self.structured.release(req.request_id)


def seeded_generator(generators: dict, req, device, salt: int = 0) -> torch.Generator | None:
    """The request's own random stream (None without a seed), made on first use and kept in
    ``generators`` by request id: a seeded request draws the same tokens whatever it is batched
    with. ``salt`` gives a second stream from the same seed (the draft model's)."""
    if req.params.seed is None:
        return None
    if req.request_id not in generators:
        generators[req.request_id] = torch.Generator(device=device).manual_seed(req.params.seed ^ salt)
    return generators[req.request_id]
