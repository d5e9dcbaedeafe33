"""The messages across the serving boundaries, without a model: the engine thread's inbox and hand-over
(``serve/async_engine.py``) and the engine-core process's wire messages (``serve/messages.py``) are typed,
so a misspelt field or an unknown question fails where it is made, not as a silent ``None`` later."""
from types import SimpleNamespace

import msgspec
import pytest

from labsupport.engine.limits import EngineLimits
from labsupport.serve.async_engine import AbortRequest, AsyncEngine, Delivery, RequestStream, _deliver
from labsupport.serve.messages import FIRST, Call, CoreInput, Ready


def fake_llm():
    """What AsyncEngine reads of an LLM before its loop starts."""
    engine = SimpleNamespace(connector=None)
    return SimpleNamespace(engine=engine, frontend=None)


def test_an_abort_reaches_the_loop_thread_as_a_typed_message():
    engine = AsyncEngine(fake_llm())
    engine.abort("r1")
    assert list(engine._inbox) == [AbortRequest("r1")]


def test_a_delivery_unpacks_as_the_stream_index_item_triple_chapter_06_reads():
    stream, index, item = Delivery("stream", 2, "output")
    assert (stream, index, item) == ("stream", 2, "output")


def test_the_serving_loop_plugs_chapter_06_pieces_through_its_registry_and_none_keeps_its_own():
    engine = AsyncEngine(fake_llm())
    assert engine.plug_points.names() == ["deliver", "stream_class"]
    mine = lambda loop, items: None  # noqa: E731
    with engine.plugged(deliver=mine, stream_class=None):
        assert engine.deliver is mine and engine.stream_class is RequestStream
    assert engine.deliver is _deliver
    with pytest.raises(ValueError, match="no plug point 'delivr' on the serving loop"):
        engine.plug_points.swap({"delivr": mine})


def test_the_core_sends_its_limits_as_an_engine_limits_object():
    limits = EngineLimits(128, 1000, 64, False, 16, 4, connector="TcpConnector")
    ready = msgspec.msgpack.Decoder(FIRST).decode(msgspec.msgpack.encode(Ready("model", limits, 8, "cpu")))
    assert ready.limits == limits and ready.limits.has_connector


def test_a_question_the_core_cannot_answer_fails_at_decoding():
    decoder = msgspec.msgpack.Decoder(CoreInput)
    assert decoder.decode(msgspec.msgpack.encode(CoreInput(calls=[Call(1, "timeline", 5.0)]))).calls[0].since == 5.0
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'metric'"):
        decoder.decode(msgspec.msgpack.encode(CoreInput(calls=[Call(1, "metric")])))
