"""What the runner hands the scheduler after one forward pass: ``ModelRunnerOutput`` (vLLM's name).

One typed record, so ``update_from_output`` reads named fields instead of a list with side attributes:
a reader sees in one place everything a step can produce, and a runner that forgets one fails loudly.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelRunnerOutput:
    """One step's results, indexed like the step's ``SchedulerOutput.requests``.

    ``token_ids[i]``: request i's sampled token (thrown away for a prompt chunk that is not the last);
    ``logprobs[i]``: its ``{token id: logprob}`` if it asked (chapter 06), else None;
    ``prompt_logprobs``: request index -> (first prompt token covered, one dict per prompt token), for the
    requests that asked and fed prompt tokens this step;
    ``spec_accepted`` / ``spec_logprobs``: speculative decoding (chapter 09), request index -> its accepted
    guesses, emitted before its token, and their logprobs (if it asked).
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)
    spec_accepted: dict[int, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)

    def __post_init__(self):
        self.token_ids = list(self.token_ids)
        if self.logprobs is None:
            self.logprobs = [None] * len(self.token_ids)
