"""KV moved between simulated engines: a connector with the engine's interface, and a link that times the bytes.

``SimConnector`` is a ``KVConnectorBase`` (vLLM's ``KVConnectorBase_V1`` shape), so the real ``Scheduler`` and
``RequestLifecycle`` of a simulated engine take the same path as under chapter 07's ``TcpConnector``: the prefill
side holds a finished request's prompt blocks (``request_finished`` -> delay free) and answers where they are; the
decode side reports the prompt's tokens as external (``get_num_new_matched_tokens``), reserves blocks for all of
them and parks the request (``start_remote_load``), starts the pull at its next step (``start_load_kv``), and takes
the request back when ``get_finished`` says it landed, with all but the last prompt token computed. What differs
is the mechanism: no bytes move; the pull lands on the virtual clock at the time ``KVLink`` gives it, and the
prefill side frees its blocks at that same time.

``KVLink``: a pull of ``b`` bytes started at ``t`` lands at ``max(t, nic free) + b / bandwidth + latency``. Pulls
into one decode engine share its link, one after another (``nic free``: when the last one's bytes are through);
the latency is paid by each but holds nothing. Bytes are whole blocks, as ``TcpConnector`` and vLLM's NIXL
connector move them: ``blocks x block_size x kv_bytes_per_token`` (``profiles.kv_bytes_per_token``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..engine.kv_connector import (KVConnectorBase, KVConnectorMetadata, LoadSpec, blocks_to_hold, load_span,
                                   register_connector, remote_tokens_to_load)


@dataclass
class Transfer:
    """One pull, in virtual seconds: asked for at ``start`` (the decode engine's step), its bytes on the wire
    from ``begin`` (after the pulls ahead of it), landed at ``end``."""

    request_id: str
    source: str
    destination: str
    num_bytes: int
    start: float
    begin: float
    end: float


@dataclass
class KVLink:
    """The link between engines (see the module's docstring); ``bandwidth_gbps`` in GB/s (1e9 bytes a second, as
    chapter 07's ``transfer_costs`` reports), ``math.inf`` for a free one."""

    bandwidth_gbps: float = math.inf
    latency_ms: float = 0.0
    connectors: dict[str, "SimConnector"] = field(default_factory=dict)  # engine id -> its connector
    nic_free: dict[str, float] = field(default_factory=dict)  # decode engine id -> when its link is free
    transfers: list[Transfer] = field(default_factory=list)

    def __post_init__(self):
        if not self.bandwidth_gbps > 0 or not self.latency_ms >= 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth_gbps} GB/s, "
                             f"{self.latency_ms} ms")

    def pull(self, request_id: str, source: str, destination: str, num_bytes: int, start: float) -> Transfer:
        begin = max(start, self.nic_free.get(destination, 0.0))
        through = begin + num_bytes / (self.bandwidth_gbps * 1e9)
        self.nic_free[destination] = through
        t = Transfer(request_id, source, destination, num_bytes, start, begin, through + self.latency_ms / 1e3)
        self.transfers.append(t)
        return t


class SimConnector(KVConnectorBase):
    """A connector whose transfers are times on the virtual clock (see the module's docstring). Each engine of a
    simulated PD cluster has one, registered on the shared ``link`` under its ``engine_id``."""

    PLUG_POINTS = {}  # no exercise plugs into it
    failure_policy = "recompute"  # read by the lifecycle for failed loads; a simulated pull never fails

    def __init__(self, engine_id: str, block_size: int, block_bytes: int, clock, link: KVLink):
        super().__init__()
        self.engine_id, self.block_size, self.block_bytes, self.clock, self.link = (
            engine_id, block_size, block_bytes, clock, link)
        self.name = "SimConnector"  # EngineLimits checks kv_transfer_params against the class registered by it
        link.connectors[engine_id] = self
        self.held: dict[str, tuple[str, float]] = {}  # transfer id -> (request id, when pulled; inf: not yet)
        self.landing: dict[str, float] = {}  # request id -> when its pull lands here
        self._pending: list[LoadSpec] = []
        self.counters = {"kv_transfer_bytes_sent": 0, "kv_transfer_bytes_received": 0}

    @staticmethod
    def check_params(params: dict | None):
        if params and params.get("do_remote_prefill"):
            if not isinstance(params.get("remote_block_ids"), list) or not params.get("remote_engine_id"):
                raise ValueError("kv_transfer_params with do_remote_prefill need remote_block_ids and remote_engine_id")

    # ------------------------------------------------------------------ scheduler side (TcpConnector's rules)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return remote_tokens_to_load(request, num_computed_tokens, self.block_size)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        p, span = request.params.kv_transfer_params, load_span(request, num_external_tokens, self.block_size)
        self._pending.append(LoadSpec(request.request_id, p["remote_request_id"], p["remote_engine_id"], 0,
                                      list(p["remote_block_ids"][span]), list(block_ids[span])))

    def build_connector_meta(self, scheduler_output):
        meta, self._pending = KVConnectorMetadata(self._pending), []
        return meta

    def request_finished(self, request, block_ids):
        prompt_blocks = blocks_to_hold(request, block_ids, self.block_size)
        if prompt_blocks is None:
            return False, None
        tid = f"{self.engine_id}-{request.request_id}"
        self.held[tid] = (request.request_id, math.inf)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                      "remote_block_ids": prompt_blocks, "remote_request_id": tid}

    # ------------------------------------------------------------------ worker side: times, not bytes

    def start_load_kv(self, metadata):
        for spec in metadata.loads:
            num_bytes = len(spec.remote_block_ids) * self.block_bytes
            t = self.link.pull(spec.request_id, spec.host, self.engine_id, num_bytes, self.clock())
            self.landing[spec.request_id] = t.end
            self.link.connectors[spec.host].pulled(spec.transfer_id, t.end, num_bytes)
            self.counters["kv_transfer_bytes_received"] += num_bytes

    def pulled(self, transfer_id: str, at: float, num_bytes: int):
        """The decode side's pull of ``transfer_id`` ends at ``at``: the held blocks go then."""
        request_id, _ = self.held[transfer_id]
        self.held[transfer_id] = (request_id, at)
        self.counters["kv_transfer_bytes_sent"] += num_bytes

    def get_finished(self, finished_req_ids=frozenset()):
        now = self.clock()
        sent = [tid for tid, (_, at) in self.held.items() if at <= now]
        recvd = {rid for rid, at in self.landing.items() if at <= now}
        for rid in recvd:
            del self.landing[rid]
        return {self.held.pop(tid)[0] for tid in sent}, recvd

    def next_event_time(self) -> float:
        """When a landing or a release next changes what this engine can schedule (inf: none is due)."""
        return min([*self.landing.values(), *(at for _, at in self.held.values())], default=math.inf)


register_connector("SimConnector", __name__, "SimConnector")
