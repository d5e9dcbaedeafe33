"""Mechanism: turn a scheduled batch into one forward pass and one new token per sequence.

The runner knows nothing about queues or policy, and changes no request. It flattens the scheduled tokens of all
sequences into one [T] tensor with their positions (no padding), runs the model once with
the attention backend, and samples from the last position of each sequence.
"""
from __future__ import annotations

import itertools

import torch

from ..models.llama import LlamaForCausalLM
from .attention import AttentionBackend, AttentionBatch, RecomputeAttention
from .plug_points import PlugPoint
from .outputs import ModelRunnerOutput
from .sampler import Sampler, logprob_dicts, option
from .spec_decode import rejection_sample
from .scheduler import SchedulerOutput


class EagerStep:
    """The plain way to run a step: the model's Python layers, every step. A device's faster way (CUDA graphs,
    the CPU's C++ decode layers: ``kernels/``) has the same two methods, and is chosen once, when the engine is
    built (``build.step_executor``)."""

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend):
        self.model, self.backend = model, backend

    def decode_logits(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """Logits of a decode-only step computed without its metadata (a CUDA graph's replay); None: not here."""
        return None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionBatch) -> torch.Tensor:
        """The hidden states of the step's tokens."""
        return self.model(token_ids, positions, self.backend, meta)


class ModelRunner:
    PLUG_POINTS = {"rejection_sample": PlugPoint("rejection_sample", "accept or reject draft tokens (ch. 09)")}

    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, device: torch.device, executor=None):
        self.model, self.backend, self.device = model, backend, device
        self.sampler = Sampler()
        self.rejection_sample = rejection_sample  # chapter 09's plug point: the acceptance rule
        self.executor = executor or EagerStep(model, backend)  # how a step's forward runs on this device

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        logits = self.executor.decode_logits(batch)
        if logits is not None:
            return self.sampler.sample(logits, batch.requests)
        token_ids, positions = [], []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            token_ids += req.all_token_ids[start:start + n]
            if start + n > req.num_tokens:  # speculative decoding: guesses after the real tokens
                token_ids += req.spec.token_ids[:start + n - req.num_tokens]
            positions += range(start, start + n)
        meta = self.backend.prepare(batch.requests, batch.num_new_tokens)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.executor.forward(ids, pos, meta)
        guesses = num_guesses(batch)
        if any(guesses):
            return self._verify(hidden, batch, meta.query_offsets, guesses)
        last = torch.tensor(meta.query_offsets[1:], device=self.device) - 1
        logits = self.model.logits(hidden[last])
        sampled = self.sampler.sample(logits, batch.requests, batch.num_new_tokens)
        sampled.prompt_logprobs = prompt_logprobs(self.model, hidden, batch, meta.query_offsets)
        return sampled

    def _verify(self, hidden: torch.Tensor, batch: SchedulerOutput, offsets: list[int], guesses: list[int]):
        """A step with guesses (chapter 09): logits at each sequence's last 1 + s positions, one product;
        sequences without guesses are sampled as usual, the others by the acceptance rule."""
        rows = [r for end, s in zip(offsets[1:], guesses) for r in range(end - 1 - s, end)]
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        ends = list(itertools.accumulate(1 + s for s in guesses))  # each sequence's rows end here in `logits`
        plain = [i for i, s in enumerate(guesses) if s == 0]
        last = logits[torch.tensor([ends[i] - 1 for i in plain], dtype=torch.long, device=self.device)]
        picked = self.sampler.sample(last, [batch.requests[i] for i in plain], [batch.num_new_tokens[i] for i in plain])
        tokens, logprobs = [0] * len(guesses), [None] * len(guesses)
        for i, token, lp in zip(plain, picked.token_ids, picked.logprobs):
            tokens[i], logprobs[i] = token, lp
        out = ModelRunnerOutput(tokens, logprobs)
        for i, s in enumerate(guesses):
            if s:
                req, end = batch.requests[i], ends[i]
                emitted, lps = self.sampler.verify(logits[end - 1 - s:end], req, req.spec.token_ids[:s],
                                                   None if req.spec.draft_probs is None else req.spec.draft_probs[:s],
                                                   self.rejection_sample)
                out.token_ids[i], out.spec_accepted[i] = emitted[-1], emitted[:-1]
                out.logprobs[i] = None if lps is None else lps[-1]
                if lps is not None:
                    out.spec_logprobs[i] = lps[:-1]
        out.prompt_logprobs = prompt_logprobs(self.model, hidden, batch, offsets)
        return out


def num_guesses(batch: SchedulerOutput) -> list[int]:
    """Guessed tokens each request feeds this step (speculative decoding): what it feeds past its real tokens."""
    return [max(0, req.num_computed_tokens + n - req.num_tokens) for req, n in zip(batch.requests, batch.num_new_tokens)]


@torch.inference_mode()
def sequence_logits(model: LlamaForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, computed from scratch: [len(token_ids), vocab].

    This is the whole model as chapter 00 sees it: tokens in, one next-token distribution per
    position out, nothing remembered between calls.
    """
    device = next(model.parameters()).device
    n = len(token_ids)
    hidden = model(torch.tensor(token_ids, device=device), torch.arange(n, device=device),
                   RecomputeAttention(), AttentionBatch([n], [n]))
    return model.logits(hidden)


PROMPT_LOGPROB_ROWS = 512  # logits for at most this many prompt positions at once: [512, vocab] float32


def prompt_logprobs(model: LlamaForCausalLM, hidden: torch.Tensor, batch: SchedulerOutput,
                    query_offsets: list[int]) -> dict[int, tuple[int, list[dict[int, float]]]]:
    """For requests that asked for ``prompt_logprobs``: the logprobs of each prompt token this step's
    positions predict (position p predicts prompt token p + 1), with the top-k at each position.

    Returns request index -> (first prompt token covered, one dict per token). A prompt fed in
    chunks gets its positions chunk by chunk; positions recorded before (a request fed again after
    preemption, or with no KV cache) are skipped. Nothing is computed when no request asked.
    """
    wanted = []  # (request index, first prompt token, hidden rows, the tokens they predict, k)
    for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
        k = option(req, "prompt_logprobs")
        if k is None or req.logprobs.prompt is None:
            continue
        start = req.num_computed_tokens
        first = max(start, len(req.logprobs.prompt) - 1)  # positions before this one are recorded already
        end = min(start + n, len(req.prompt_token_ids) - 1)  # the last prompt position predicts an output token
        if first < end:
            rows = range(query_offsets[i] + first - start, query_offsets[i] + end - start)
            wanted.append((i, first + 1, rows, req.prompt_token_ids[first + 1:end + 1], k))
    if not wanted:
        return {}
    rows = torch.tensor([r for w in wanted for r in w[2]], device=hidden.device)
    targets = [t for w in wanted for t in w[3]]
    ks = [w[4] for w in wanted for _ in w[2]]
    found = []
    for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):  # bounded memory for a long prompt
        part = slice(at, at + PROMPT_LOGPROB_ROWS)
        logprobs = torch.log_softmax(model.logits(hidden[rows[part]]).float(), dim=-1)
        found += logprob_dicts(logprobs, targets[part], ks[part])
    out, at = {}, 0
    for i, first, rows_i, _, _ in wanted:
        out[i] = (first, found[at:at + len(rows_i)])
        at += len(rows_i)
    return out
