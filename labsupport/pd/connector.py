"""The TCP pull connector: how an engine gets KV it did not compute over a socket, and gives away KV it did.

The interface it implements (vLLM's ``KVConnectorBase_V1`` shape) and the factory that builds a connector from
``kv_transfer_config`` are the engine's, in ``engine/kv_connector.py``; this package holds the implementation.

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
from dataclasses import dataclass

from ..engine.kv_connector import (KVConnectorBase, KVConnectorMetadata, LoadSpec, blocks_to_hold, load_span,
                                   remote_tokens_to_load)
from ..engine.plug_points import PlugPoint
from .kv_transfer import KVServer, TransferRecord, pull_blocks, unpack_blocks

log = logging.getLogger(__name__)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")  # vLLM's kv_load_failure_policy values


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

    PLUG_POINTS = {  # chapter 07's exercise: the two ends of the wire
        "pack_blocks": PlugPoint("server.pack_blocks", "blocks of the pool -> the bytes sent"),
        "unpack_blocks": PlugPoint("unpack_blocks", "the bytes received -> other blocks of this pool"),
    }

    def __init__(self, k_pool, v_pool, block_size: int, engine_id: str | None = None, kv_ip: str = "127.0.0.1",
                 kv_port: int = 0, kv_lease_s: float = 30.0, kv_load_failure_policy: str = "recompute",
                 pull_timeout_s: float = 10.0):
        if kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {kv_load_failure_policy!r}")
        if not kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be a positive number of seconds, got {kv_lease_s!r}")
        super().__init__()
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
        self.server = KVServer(k_pool, v_pool, block_size, self._lookup, self._on_sent, kv_ip, kv_port)
        self.unpack_blocks = unpack_blocks  # a plug point (PLUG_POINTS above); server.pack_blocks is the sending side's

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
        return remote_tokens_to_load(request, num_computed_tokens, self.block_size)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        p, span = request.params.kv_transfer_params, load_span(request, num_external_tokens, self.block_size)
        self._pending.append(LoadSpec(request.request_id, str(p["remote_request_id"]), str(p["remote_host"]),
                                      int(p["remote_port"]), [int(b) for b in p["remote_block_ids"][span]],
                                      list(block_ids[span])))

    def build_connector_meta(self, scheduler_output):
        meta, self._pending = KVConnectorMetadata(self._pending), []
        return meta

    def request_finished(self, request, block_ids):
        prompt_blocks = blocks_to_hold(request, block_ids, self.block_size)
        if prompt_blocks is None:
            return False, None
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
        self._transfer_ended()

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
        self._transfer_ended()

    def _record(self, record: TransferRecord):
        self.records.append(record)
        del self.records[:-1000]
        key = "kv_transfer_bytes_sent" if record.role == "send" else "kv_transfer_bytes_received"
        self.counters[key] += record.num_bytes

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
