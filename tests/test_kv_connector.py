"""The KV connector interface and factory of ``engine/kv_connector.py``, without a model: the factory builds
only registered ``KVConnectorBase`` classes, a connector wakes its listeners when a transfer ends (the serving
loop's declared hook), and a prompt's ``kv_transfer_params`` are checked by the named connector's class."""
import socket
import threading

import pytest
import torch

from labsupport.engine.kv_connector import (KVConnectorBase, KVConnectorMetadata, LoadSpec, connector_class,
                                            make_connector, register_connector)
from labsupport.engine.limits import EngineLimits
from labsupport.engine.request import SamplingParams


class Pools:
    """The three things a connector reads of an attention backend."""
    block_size = 4
    k_pool = [torch.zeros(1, 16, 8)]
    v_pool = [torch.zeros(1, 16, 8)]


def test_the_interface_cannot_be_built_without_its_scheduler_and_worker_sides():
    with pytest.raises(TypeError, match="abstract"):
        KVConnectorBase()


def test_the_factory_refuses_an_unknown_name_and_a_class_that_is_no_connector():
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        make_connector({"kv_connector": "NixlConnector"}, Pools())
    register_connector("NotAConnector", "labsupport.engine.limits", "EngineLimits")
    try:
        with pytest.raises(TypeError, match="is not a KVConnectorBase"):
            connector_class("NotAConnector")
    finally:
        from labsupport.engine import kv_connector
        del kv_connector.CONNECTORS["NotAConnector"]
    with pytest.raises(ValueError, match="unknown kv_transfer_config keys"):
        make_connector({"kv_connector": "TcpConnector", "kv_port_number": 1}, Pools())


def test_a_failed_load_wakes_the_listeners_of_whoever_steps_the_engine():
    connector = make_connector({"kv_connector": "TcpConnector", "pull_timeout_s": 2.0}, Pools())
    try:
        assert connector.name == "TcpConnector" and connector.role == "kv_both"
        woken = threading.Event()
        connector.transfer_listeners.append(woken.set)
        with socket.socket() as unused:  # a port nobody listens on: the pull fails at once
            unused.bind(("127.0.0.1", 0))
            port = unused.getsockname()[1]
        connector.start_load_kv(KVConnectorMetadata([LoadSpec("r1", "t1", "127.0.0.1", port, [0], [1])]))
        assert woken.wait(10), "the end of a transfer did not wake the listener"
        assert "r1" in connector.get_failed_loads()
    finally:
        connector.close()


def test_the_named_connector_checks_kv_transfer_params_when_the_request_is_made():
    limits = EngineLimits(128, 1000, 64, False, 16, 4, connector="TcpConnector")
    bad = SamplingParams(kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": "0,1"})
    with pytest.raises(ValueError, match="remote_block_ids must be a list"):
        limits.check_params(bad)
    without = EngineLimits(128, 1000, 64, False, 16, 4)
    with pytest.raises(ValueError, match="needs an engine with a KV connector"):
        without.check_params(bad)
