"""The KV connector interface and its factory: how an engine gets KV it did not compute, and gives away KV it did.

The interface is vLLM's ``KVConnectorBase_V1``, method for method, so chapter 08 reads vLLM's
connectors (ExampleConnector, NixlConnector, LMCacheConnectorV1, ...) as variations of this one.
It has two sides, which vLLM runs in different processes and we run in one:

**Scheduler side** (policy: who waits for what, who holds which blocks)

* ``get_num_new_matched_tokens(request, num_computed_tokens) -> (n, load_async)``: how many of
  the request's tokens beyond what this engine has can come from elsewhere. ``load_async``:
  the request waits (``WAITING_FOR_REMOTE_KVS``) while they arrive, and the engine keeps
  stepping the others.
* ``update_state_after_alloc(request, block_ids, num_external_tokens)``: blocks were reserved
  for those tokens; remember which local blocks to fill.
* ``build_connector_meta(scheduler_output)``: what the worker side must start this step.
* ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)``: a request left.
  ``delay_free=True`` keeps its blocks out of the free list until the transfer is done; the
  params go back to the client (the router), saying where to fetch the KV from.

**Worker side** (mechanism: bytes)

* ``start_load_kv(metadata)``; ``wait_for_layer_load(layer)`` (inside the forward pass: block
  until this layer's KV is in, for connectors that load during the forward);
  ``save_kv_layer(layer, k_pool, v_pool, attn_metadata)`` (right after a layer wrote its KV: a
  push connector sends it now, overlapping the next layer's compute); ``wait_for_save()``
  (the end of the forward pass); ``get_finished(finished_req_ids) -> (done_sending,
  done_recving)`` (transfers that completed since the last call).

The engine gives its connector to the parts that call it, explicitly: ``Scheduler(..., connector=...)`` (the
scheduler side) and ``PagedAttention.attach_connector`` (the per-layer worker hooks). Whoever steps the engine
(``serve/async_engine.py``) adds a callable to ``transfer_listeners`` to be woken when a transfer ends.

The implementations live in ``labsupport/pd/`` (``TcpConnector``). The factory knows them by name and module
path, as vLLM's ``KVConnectorFactory`` does, and imports one only when a ``kv_transfer_config`` asks for it:
the engine depends on this interface, never on a transport.
"""
from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import Callable

from .block_pool import blocks_needed


@dataclass
class LoadSpec:
    """One request's KV to fetch: from which engine (``host``, ``port``, ``transfer_id``), which remote blocks
    into which local ones."""

    request_id: str
    transfer_id: str
    host: str
    port: int
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step."""

    loads: list[LoadSpec] = field(default_factory=list)


class KVConnectorBase(abc.ABC):
    """vLLM's ``KVConnectorBase_V1`` shape. The scheduler side and ``start_load_kv``/``get_finished`` are
    abstract (every connector has its own answer); the per-layer hooks, failed loads and ``close`` default to
    nothing, for connectors that load whole requests and hold no resources."""

    def __init__(self):
        # called with no arguments, from any thread, when a transfer ends: the engine's stepper wakes and polls
        self.transfer_listeners: list[Callable[[], None]] = []

    @staticmethod
    def check_params(params: dict | None):
        """Refuse (ValueError) ``kv_transfer_params`` this connector could not follow, when the request is made:
        found later, inside a step, a bad field would fail the step's other requests too."""

    # ---- scheduler side
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int):
        ...

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        ...

    @abc.abstractmethod
    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        ...

    # ---- worker side
    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata):
        ...

    def wait_for_layer_load(self, layer: int):
        pass

    def save_kv_layer(self, layer: int, k_pool, v_pool, attn_metadata):
        pass

    def wait_for_save(self):
        pass

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str] = frozenset()) -> tuple[set[str], set[str]]:
        ...

    def get_failed_loads(self) -> dict[str, str]:
        """Request id -> why, for loads that failed since the last call (vLLM: block ids with load errors)."""
        return {}

    def close(self):
        pass

    def _transfer_ended(self):
        for listener in list(self.transfer_listeners):
            listener()


# name -> (module, class): imported when a kv_transfer_config names it, so the engine imports no transport
CONNECTORS = {"TcpConnector": ("labsupport.pd.connector", "TcpConnector")}


# The scheduler-side rules every pulling connector shares (``pd/connector.py``'s TCP one, ``sim/kv_link.py``'s
# simulated one): which prompt tokens come from another engine, which blocks a load fills, which a finished
# prefill keeps for the pull. One place, so a simulated hand-off follows the real one.

def remote_tokens_to_load(request, num_computed_tokens: int, block_size: int) -> tuple[int, bool]:
    """``get_num_new_matched_tokens`` of a pulling connector: the prompt tokens past ``num_computed_tokens`` that
    another engine computed, and whether to load them asynchronously; (0, False) when the request is not a remote
    prefill's, its load is done, or the prefill side has fewer blocks than the prompt (then it is computed here)."""
    p = request.params.kv_transfer_params or {}
    if not p.get("do_remote_prefill") or request.remote_kv.load_done:
        return 0, False
    prompt = len(request.prompt_token_ids)
    if blocks_needed(prompt, block_size) > len(p.get("remote_block_ids") or []):
        return 0, False
    return max(prompt - num_computed_tokens, 0), True


def load_span(request, num_external_tokens: int, block_size: int) -> slice:
    """The prompt blocks a load fills: after the local prefix hits, up to the prompt's last block."""
    first = (len(request.prompt_token_ids) - num_external_tokens) // block_size  # local hits end here
    return slice(first, blocks_needed(len(request.prompt_token_ids), block_size))


def blocks_to_hold(request, block_ids: list[int], block_size: int) -> list[int] | None:
    """A finished remote-decode request's prompt blocks, kept for the decode engine's pull; None when none are kept
    (not a prefill for another engine, not finished normally, or no blocks)."""
    p = request.params.kv_transfer_params or {}
    if not p.get("do_remote_decode") or request.finish_reason not in ("stop", "length") or not block_ids:
        return None
    return list(block_ids[:blocks_needed(len(request.prompt_token_ids), block_size)])


def register_connector(name: str, module: str, class_name: str):
    """Make ``kv_connector=name`` build ``module.class_name`` (a ``KVConnectorBase``), as vLLM's
    ``KVConnectorFactory.register_connector``."""
    CONNECTORS[name] = (module, class_name)


def connector_class(name: str) -> type[KVConnectorBase]:
    if name not in CONNECTORS:
        raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}, got {name!r}")
    module, class_name = CONNECTORS[name]
    cls = getattr(importlib.import_module(module), class_name)
    if not issubclass(cls, KVConnectorBase):
        raise TypeError(f"{module}.{class_name} is not a KVConnectorBase")
    return cls


def make_connector(config: dict, backend) -> KVConnectorBase:
    """A connector from vLLM-style ``kv_transfer_config`` (``{"kv_connector": "TcpConnector", "kv_role":
    "kv_both", "kv_ip": ..., "kv_port": ..., "engine_id": ..., "kv_load_failure_policy": ..., "kv_lease_s": ...}``)
    on ``backend``'s pool."""
    config = dict(config)
    name = config.pop("kv_connector", "TcpConnector")
    cls = connector_class(name)
    role = config.pop("kv_role", "kv_both")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    extra = config.pop("kv_connector_extra_config", {}) or {}
    known = {"engine_id", "kv_ip", "kv_port", "kv_lease_s", "kv_load_failure_policy", "pull_timeout_s"}
    unknown = set(config) - known
    if unknown:
        raise ValueError(f"unknown kv_transfer_config keys {sorted(unknown)}; known: {sorted(known)}")
    connector = cls(backend.k_pool, backend.v_pool, backend.block_size, **config, **extra)
    connector.name, connector.role = name, role  # the factory's name for it (EngineLimits sends it to a frontend)
    return connector
