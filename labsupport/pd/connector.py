"""KV connectors: how an engine gets KV it did not compute, and gives away KV it did.

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

``TcpConnector`` implements it the way vLLM's NixlConnector does (pull, not push): the prefill
worker keeps a finished request's blocks and advertises them; the decode worker pulls them over
TCP (``kv_transfer.py``) into blocks it allocated, layer frame by layer frame, then recomputes
only the prompt's last token to get its logits. Pull suits disaggregation: the decode side
decides when it has room, and a lost decode worker costs the prefill worker only a lease
(``kv_lease_s``) after which its blocks return to the pool.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

from ..engine.block_pool import blocks_needed
from .kv_transfer import KVServer, TransferRecord, pull_blocks, unpack_blocks

log = logging.getLogger(__name__)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")  # vLLM's kv_load_failure_policy values


@dataclass
class LoadSpec:
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


class KVConnectorBase:
    """vLLM's ``KVConnectorBase_V1`` shape; this base does nothing (an engine without a connector)."""

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int):
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None

    # ---- worker side
    def start_load_kv(self, metadata: KVConnectorMetadata):
        pass

    def wait_for_layer_load(self, layer: int):
        pass

    def save_kv_layer(self, layer: int, k_pool, v_pool, attn_metadata):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids: set[str] = frozenset()) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_failed_loads(self) -> dict[str, str]:
        """Request id -> why, for loads that failed since the last call (vLLM: block ids with load errors)."""
        return {}

    def close(self):
        pass


@dataclass
class Held:
    request_id: str
    block_ids: list[int]
    deadline: float  # time.monotonic(): the lease; after it the blocks are freed even if never pulled
    pulling: int = 0  # pulls in progress: a lease does not expire under a transfer


class TcpConnector(KVConnectorBase):
    """Pull over TCP (see the module docstring). Every engine with it can do both roles, as vLLM's
    ``kv_role="kv_both"``: a request with ``do_remote_decode`` gives its KV away when it finishes,
    a request with ``do_remote_prefill`` takes its prompt's KV from the engine named in its params."""

    def __init__(self, k_pool, v_pool, block_size: int, engine_id: str | None = None, kv_ip: str = "127.0.0.1",
                 kv_port: int = 0, kv_lease_s: float = 30.0, kv_load_failure_policy: str = "recompute",
                 pull_timeout_s: float = 10.0):
        if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {kv_load_failure_policy!r}")
        if not kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be a positive number of seconds, got {kv_lease_s!r}")
        self.k_pool, self.v_pool, self.block_size = k_pool, v_pool, block_size
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.lease_s, self.failure_policy, self.pull_timeout_s = kv_lease_s, kv_load_failure_policy, pull_timeout_s
        self._lock = threading.Lock()  # held/_sent/_recvd/_failed are touched by the KV threads too
        self.held: dict[str, Held] = {}  # transfer id -> blocks kept for a decode worker
        self._sent: set[str] = set()  # transfer ids acknowledged or expired, not yet reported
        self._recvd: set[str] = set()
        self._failed: dict[str, str] = {}
        self._pending: list[LoadSpec] = []  # scheduler side: loads to start at the next build_connector_meta
        self.records: list[TransferRecord] = []  # every finished transfer, both directions (bounded)
        self.counters = {"kv_transfer_bytes_sent": 0, "kv_transfer_bytes_received": 0, "kv_leases_expired": 0,
                         "kv_loads_failed": 0}
        self.wake = None  # set by whoever steps the engine: called when a transfer ends
        self.server = KVServer(k_pool, v_pool, block_size, self._lookup, self._on_sent, kv_ip, kv_port)
        self.unpack_blocks = unpack_blocks  # the exercise's plug point on the receiving side (server.pack_blocks: sending)

    @staticmethod
    def check_params(params: dict | None):
        """Refuse (ValueError) ``kv_transfer_params`` this connector could not follow, when the request is
        made: found later, inside a step, a bad field would fail the step's other requests too."""
        if not params or not params.get("do_remote_prefill"):
            return
        ids, port = params.get("remote_block_ids"), params.get("remote_port")
        if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids (integers >= 0)")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"kv_transfer_params.remote_port must be a TCP port, got {port!r}")
        for name in ("remote_host", "remote_request_id"):
            if not isinstance(params.get(name), str) or not params[name]:
                raise ValueError(f"kv_transfer_params.{name} must be a non-empty string, got {params.get(name)!r}")

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.params.kv_transfer_params or {}
        if not p.get("do_remote_prefill") or request.remote_kv.load_done:
            return 0, False
        remote = p.get("remote_block_ids") or []
        prompt = len(request.prompt_token_ids)
        if blocks_needed(prompt, self.block_size) > len(remote):
            return 0, False  # the prefill side has less than the prompt: compute it here
        return max(prompt - num_computed_tokens, 0), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        p = request.params.kv_transfer_params
        first = (len(request.prompt_token_ids) - num_external_tokens) // self.block_size  # local hits end here
        last = blocks_needed(len(request.prompt_token_ids), self.block_size)
        self._pending.append(LoadSpec(request.request_id, str(p["remote_request_id"]), str(p["remote_host"]),
                                      int(p["remote_port"]), [int(b) for b in p["remote_block_ids"][first:last]],
                                      list(block_ids[first:last])))

    def build_connector_meta(self, scheduler_output):
        meta, self._pending = KVConnectorMetadata(self._pending), []
        return meta

    def request_finished(self, request, block_ids):
        p = request.params.kv_transfer_params or {}
        if not p.get("do_remote_decode") or request.finish_reason not in ("stop", "length") or not block_ids:
            return False, None
        prompt_blocks = list(block_ids[:blocks_needed(len(request.prompt_token_ids), self.block_size)])
        tid = f"{self.engine_id}-{request.request_id}"
        with self._lock:
            self.held[tid] = Held(request.request_id, prompt_blocks, time.monotonic() + self.lease_s)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_block_ids": prompt_blocks, "remote_host": self.server.host,
                      "remote_port": self.server.port, "remote_request_id": tid, "tp_size": 1}

    def held_request_ids(self) -> dict[str, str]:
        with self._lock:
            return {tid: h.request_id for tid, h in self.held.items()}

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, metadata):
        for spec in metadata.loads:
            threading.Thread(target=self._load, args=(spec,), name="kv-recv", daemon=True).start()

    def _load(self, spec: LoadSpec):
        try:
            record = pull_blocks(spec.host, spec.port, spec.transfer_id, spec.remote_block_ids, self.k_pool,
                                 self.v_pool, spec.local_block_ids, self.block_size, self.pull_timeout_s,
                                 self.unpack_blocks)
            with self._lock:
                self._recvd.add(spec.request_id)
                self._record(record)
        except Exception as exc:
            log.warning("KV load for %s from %s:%s failed: %s", spec.request_id, spec.host, spec.port, exc)
            with self._lock:
                self._failed[spec.request_id] = f"{type(exc).__name__}: {exc}"
                self.counters["kv_loads_failed"] += 1
        self._wake()

    def get_finished(self, finished_req_ids=frozenset()):
        """(request ids whose held blocks may be freed: pulled or lease expired, request ids whose load landed)."""
        now = time.monotonic()
        with self._lock:
            for tid, h in list(self.held.items()):
                if h.deadline < now and not h.pulling:
                    self._sent.add(tid)
                    self.counters["kv_leases_expired"] += 1
            done = {self.held.pop(tid).request_id for tid in self._sent if tid in self.held}
            recvd, self._sent, self._recvd = self._recvd, set(), set()
        return done, recvd

    def get_failed_loads(self):
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    # ------------------------------------------------------------------ the KV server's callbacks

    def _lookup(self, tid: str):
        with self._lock:
            h = self.held.get(tid)
            if h is None or tid in self._sent:
                return None
            h.pulling += 1  # released in _on_sent, or below if the send fails
            return _Lease(self, tid, h.block_ids)

    def _on_sent(self, tid: str, record: TransferRecord):
        with self._lock:
            self._sent.add(tid)
            self._record(record)
        self._wake()

    def _record(self, record: TransferRecord):
        self.records.append(record)
        del self.records[:-1000]
        key = "kv_transfer_bytes_sent" if record.role == "send" else "kv_transfer_bytes_received"
        self.counters[key] += record.num_bytes

    def _wake(self):
        if self.wake is not None:
            self.wake()

    def close(self):
        self.server.close()


class _Lease(list):
    """The block ids a pull may read; ``release()`` ends the pull (the server calls it when done or failed)."""

    def __init__(self, connector: TcpConnector, tid: str, block_ids: list[int]):
        super().__init__(block_ids)
        self.connector, self.tid = connector, tid

    def release(self):
        with self.connector._lock:
            h = self.connector.held.get(self.tid)
            if h is not None:
                h.pulling -= 1


CONNECTORS = {"TcpConnector": TcpConnector}


def make_connector(config: dict, backend) -> KVConnectorBase:
    """A connector from vLLM-style ``kv_transfer_config`` (``{"kv_connector": "TcpConnector", "kv_role":
    "kv_both", "kv_ip": ..., "kv_port": ..., "engine_id": ..., "kv_load_failure_policy": ..., "kv_lease_s": ...}``)."""
    config = dict(config)
    name = config.pop("kv_connector", "TcpConnector")
    if name not in CONNECTORS:
        raise ValueError(f"kv_connector must be one of {sorted(CONNECTORS)}, got {name!r}")
    role = config.pop("kv_role", "kv_both")
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ValueError(f"kv_role must be kv_producer, kv_consumer or kv_both, got {role!r}")
    extra = config.pop("kv_connector_extra_config", {}) or {}
    known = {"engine_id", "kv_ip", "kv_port", "kv_lease_s", "kv_load_failure_policy", "pull_timeout_s"}
    unknown = set(config) - known
    if unknown:
        raise ValueError(f"unknown kv_transfer_config keys {sorted(unknown)}; known: {sorted(known)}")
    connector = CONNECTORS[name](backend.k_pool, backend.v_pool, backend.block_size, **config, **extra)
    connector.role = role
    return connector
