"""vLLM's ``priority`` body field on a real loopback server, with the engine in the server's process and in an
engine-core process of its own: under ``--scheduling-policy priority`` the waiting requests are served by it,
on both routes; under any other policy a priority other than 0 is a 400 in vLLM's words, never ignored."""
import threading
import time

import httpx
import msgspec
import pytest
from server_tools import assert_openai_error, post, server_metrics
from waiting import wait_until

from labsupport import LLM
from labsupport.engine.limits import EngineLimits
from labsupport.serve.api import create_app
from labsupport.serve.background import BackgroundServer
from labsupport.serve.core_client import EngineCoreClient
from labsupport.serve.messages import FIRST, AddRequest, CoreInput, Ready

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
Q = [{"role": "user", "content": "Name a fruit that is yellow."}]
OPTIONS = dict(device="cpu", max_num_seqs=1, num_blocks=64, max_model_len=1024, scheduling_policy="priority")


@pytest.fixture(scope="module", params=["in_process", "core"])
def priority_server(request):
    source = LLM(**OPTIONS) if request.param == "in_process" else EngineCoreClient(OPTIONS, "smol")
    with BackgroundServer(create_app(source, "smol")) as srv:
        yield srv
    source.shutdown()


@pytest.fixture(scope="module")
def fcfs_server(llm):
    with BackgroundServer(create_app(llm, "smol")) as srv:
        yield srv


def waiting(srv) -> float:
    return server_metrics(srv)["labsupport:num_requests_waiting"]


def wait_for_queue(srv, n: int):
    wait_until(lambda: waiting(srv) == n, timeout=120, interval=0.05, message=f"the queue holds {n} requests")


def test_waiting_requests_are_served_by_priority_not_arrival(priority_server):
    """One slot, held by a long request; behind it a text completion with priority 3, then a chat with priority 1.
    When the long one leaves (its client hangs up), the chat, which arrived second, is served first: its priority
    crossed the HTTP body, the frontend and (for the engine-core process) the process boundary."""
    done, status = {}, {}

    def short(name, path, body):
        r = httpx.post(priority_server.url + path, json={"model": "smol", "max_tokens": 4, "ignore_eos": True, **body},
                       timeout=300)
        status[name], done[name] = r.status_code, time.perf_counter()

    threads = []
    body = {"model": "smol", "messages": Q, "max_tokens": 400, "ignore_eos": True, "priority": 5, "stream": True}
    with httpx.stream("POST", priority_server.url + CHAT, json=body, timeout=300) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped line iterator closes the response, and the request goes
        next(line for line in lines if line.startswith("data: "))  # it holds the one slot
        for n, (name, path, body) in enumerate([("first-arrived", TEXT, {"prompt": "The capital of France is",
                                                                          "priority": 3}),
                                                ("more-urgent", CHAT, {"messages": Q, "priority": 1})], start=1):
            threads.append(threading.Thread(target=short, args=(name, path, body)))
            threads[-1].start()
            wait_for_queue(priority_server, n)  # queued, in this order, behind the long request
    for t in threads:  # the long request's client hung up: its slot is free
        t.join(300)
    assert status == {"first-arrived": 200, "more-urgent": 200}, status
    assert done["more-urgent"] < done["first-arrived"]


@pytest.mark.parametrize("path, body", [(CHAT, {"messages": Q}), (TEXT, {"prompt": "Hello"})])
def test_a_priority_without_the_priority_policy_is_a_400_in_vllms_words(fcfs_server, path, body):
    r = post(fcfs_server, {"model": "smol", "max_tokens": 2, "priority": -2, **body}, path)
    assert_openai_error(r.status_code, r.json(), 400)
    error = r.json()["error"]
    assert error["message"].startswith("Got priority -2 but Priority scheduling is not enabled."), error
    assert "--scheduling-policy priority" in error["message"] and error["param"] == "priority"
    assert post(fcfs_server, {"model": "smol", "max_tokens": 2, "priority": 0, **body}, path).status_code == 200


@pytest.mark.parametrize("value", ["1", 1.5, True, 1 << 63, None])
def test_a_priority_that_is_not_a_64_bit_integer_is_a_400(fcfs_server, value):
    r = post(fcfs_server, {"model": "smol", "max_tokens": 2, "messages": Q, "priority": value})
    assert_openai_error(r.status_code, r.json(), 400)
    assert "priority" in r.json()["error"]["message"], r.json()


def test_the_priority_and_the_policy_cross_the_process_boundary_typed():
    """The core's first message tells the frontend its policy (the frontend answers the 400); each request's
    priority travels in its ``AddRequest``."""
    limits = EngineLimits(1024, 100, 256, True, scheduling_policy="priority")
    ready = msgspec.msgpack.decode(msgspec.msgpack.encode(Ready("m", limits, 4, "cpu")), type=FIRST)
    assert ready.limits.scheduling_policy == "priority"
    ready.limits.check_priority(7)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        EngineLimits(1024, 100, 256, True).check_priority(7)
    sent = CoreInput(adds=[AddRequest("r", [1, 2], {}, None, 1.0, -4), AddRequest("s", [3], {})])
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=CoreInput)
    assert [a.priority for a in got.adds] == [-4, 0]
