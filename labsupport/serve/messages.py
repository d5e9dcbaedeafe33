"""The messages between the server's frontend process and its engine-core process (msgspec + msgpack).

One message each way per turn, as in vLLM V1 (``EngineCoreRequest`` in, ``EngineCoreOutputs`` out):
the frontend sends everything one event-loop tick gathered (new requests, aborts, questions) as one
``CoreInput``; the core answers each step with one ``CoreOutputs`` carrying every request's new
token ids. Typed structs, not tuples or dicts, so a field misspelt on one side is an error at
decoding, not a silent ``None``; ``array_like`` keeps them small on the wire (field order, not names).
Text never crosses: the frontend tokenizes before and detokenizes after, so the core's process
spends its time, and its GIL, on the model.
"""
from __future__ import annotations

from typing import Literal

import msgspec

from ..engine.limits import EngineLimits


class AddRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # ``SamplingParams`` fields; the core makes (and so checks) the object again
    cache_salt: str | None = None
    arrival_time: float = 0.0  # the frontend's ``perf_counter()`` (one clock for both processes on Linux)
    priority: int = 0  # scheduling_policy="priority": smaller first (vLLM's EngineCoreRequest.priority)


class FinishRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """End a request now: ``abort`` (its client left) or ``stop`` (the frontend found a stop string)."""

    request_id: str
    reason: str = "abort"
    keep_tokens: int | None = None  # ``stop``: the output tokens up to the stop string; the rest never were


class Call(msgspec.Struct, array_like=True, omit_defaults=True):
    """A question for the core, answered between steps: ``metrics``, ``timeline``, ``stats``. The name is one of
    those three and the argument a typed field, so a question the core cannot answer fails at decoding."""

    call_id: int
    name: Literal["metrics", "timeline", "stats"]
    since: float = 0.0  # ``timeline``: steps and transfers that ended after this wall-clock time


class CoreInput(msgspec.Struct, array_like=True, omit_defaults=True):
    adds: list[AddRequest] = []
    finishes: list[FinishRequest] = []
    calls: list[Call] = []
    shutdown: bool = False


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request got in one step, or how it ended."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[dict[int, float]] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, with the first token
    token_time: float = 0.0  # when this step's tokens came out (``perf_counter``)
    first_scheduled_time: float | None = None  # sent once, with the first delta
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    finished_time: float | None = None
    kv_transfer_params: dict | None = None  # PD: where a prefill worker's KV waits for the decode worker
    error: str | None = None  # the core refused the request when it arrived


class Answer(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    value: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None


class CoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    deltas: list[RequestDelta] = []
    answers: list[Answer] = []
    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue, KV loads included


class Ready(msgspec.Struct, array_like=True, tag=True):
    """The core's first message: the engine is built; what the frontend needs to check and tokenize."""

    model_path: str
    limits: EngineLimits  # a dataclass, encoded field by field and made again (checked) on the other side
    max_num_seqs: int
    device: str


class Failed(msgspec.Struct, array_like=True, tag=True):
    """The core's first message when the engine could not be built (a bad option: the CLI says it and exits 2)."""

    error: str
    bad_option: bool = False


FIRST = Ready | Failed
