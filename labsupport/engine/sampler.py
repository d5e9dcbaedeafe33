"""Turn the last position's logits into the next token.

Greedy (temperature 0) is argmax, which is what makes our tokens comparable with
``transformers`` token for token. Otherwise: temperature, then nucleus (top-p) filtering,
then a draw from a per-request generator, so a fixed ``seed`` gives the same text no matter
which other requests share the batch.
"""
from __future__ import annotations

import torch

from .request import Request


class Sampler:
    def __init__(self):
        self.generators: dict[str, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [num_requests, vocab] float32 -> one token id per request."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(requests):
            if not req.params.greedy:
                tokens[i] = self._draw(logits[i], req)
        return tokens

    def _draw(self, logits: torch.Tensor, req: Request) -> int:
        probs = torch.softmax(logits / req.params.temperature, dim=-1)
        if req.params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # keep the smallest set whose mass reaches top_p (always at least the top token)
            drop = sorted_p.cumsum(-1) - sorted_p > req.params.top_p
            sorted_p[drop] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        gen = self._generator(req, probs.device)
        return int(torch.multinomial(probs, 1, generator=gen))

    def _generator(self, req: Request, device) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        if req.request_id not in self.generators:
            self.generators[req.request_id] = torch.Generator(device=device).manual_seed(req.params.seed)
        return self.generators[req.request_id]

    def release(self, req: Request):
        self.generators.pop(req.request_id, None)
