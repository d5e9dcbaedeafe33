"""The plug-point registry and the run-time options, without a model: what each component declares, how a piece
goes in and comes back, and that a restored configuration went through ``EngineConfig``'s own checks."""
import operator

import pytest

from labsupport.engine.attention import ContiguousAttention
from labsupport.engine.block_pool import BlockAllocator
from labsupport.engine.config import EngineConfig
from labsupport.engine.kv_cache_manager import KVCacheManager
from labsupport.engine.paged_attention import PagedAttention
from labsupport.engine.plug_points import PlugPoint, PlugRegistry, RuntimeOptions
from labsupport.engine.runner import ModelRunner
from labsupport.engine.scheduler import Scheduler
from labsupport.pd.connector import TcpConnector
from labsupport.serve.async_engine import AsyncEngine


class Owner:
    PLUG_POINTS = {"rule": PlugPoint("rule", "rule(x) -> y"),
                   "policy": PlugPoint("policy", "a policy; None: the default", kind="function or None"),
                   "inner_fn": PlugPoint("part.fn", "a function of a part this owner owns")}

    def __init__(self):
        self.rule, self.policy = abs, None
        self.part = type("Part", (), {})()
        self.part.fn = len


class Refuses:
    PLUG_POINTS = {"thing": PlugPoint("thing", "anything the owner accepts", kind="object", install="take")}

    def __init__(self):
        self.thing = "own"

    def take(self, thing):
        if thing == "bad":
            raise ValueError("refused")
        self.thing = thing


def test_every_engine_component_declares_plug_points_that_name_its_own_attributes():
    declared = {cls: cls.PLUG_POINTS for cls in (Scheduler, KVCacheManager, PagedAttention, ContiguousAttention,
                                                  ModelRunner, TcpConnector, AsyncEngine)}
    names = [name for points in declared.values() for name in points]
    assert len(names) == len(set(names)), "a plug point name is declared twice"
    assert {"schedule_fn", "block_allocator", "decode_attention", "attend_fn", "rejection_sample", "pack_blocks",
            "unpack_blocks", "deliver", "stream_class"} <= set(names)
    scheduler = Scheduler(EngineConfig(), KVCacheManager(8, 4))
    for name, point in Scheduler.PLUG_POINTS.items():  # a dotted attribute reaches a part the scheduler owns
        assert callable(operator.attrgetter(point.attribute)(scheduler)) or point.kind != "function", name
    kv = KVCacheManager(8, 4)
    for name, point in KVCacheManager.PLUG_POINTS.items():
        assert hasattr(kv, point.attribute), name


def test_plugged_swaps_a_piece_and_puts_the_old_one_back_also_after_an_exception():
    owner = Owner()
    registry = PlugRegistry(owner)
    with pytest.raises(RuntimeError):
        with registry.plugged({"rule": round, "inner_fn": sorted, "policy": max}):
            assert (owner.rule, owner.part.fn, owner.policy) == (round, sorted, max)
            raise RuntimeError("the attendee's code failed")
    assert (owner.rule, owner.part.fn, owner.policy) == (abs, len, None)


def test_a_wrong_name_or_a_non_function_changes_nothing():
    owner = Owner()
    registry = PlugRegistry(owner, describe="the test owner")
    with pytest.raises(ValueError, match="no plug point 'rul' on the test owner"):
        registry.swap({"rule": round, "rul": round})
    with pytest.raises(ValueError, match="rule must be a function"):
        registry.swap({"policy": max, "rule": 3})
    assert (owner.rule, owner.policy) == (abs, None)
    registry.swap({"policy": None})  # None is the default policy, a valid piece here
    with pytest.raises(ValueError, match="must be a function"):
        registry.swap({"rule": None})


def test_a_piece_its_owner_refuses_takes_the_pieces_already_swapped_out_again():
    owner, refuses = Owner(), Refuses()
    registry = PlugRegistry(owner, refuses, None)  # None: a part this engine lacks
    with pytest.raises(ValueError, match="refused"):
        registry.swap({"rule": round, "thing": "bad"})
    assert (owner.rule, refuses.thing) == (abs, "own")
    assert registry.swap({"thing": "mine"}) == {"thing": "own"} and refuses.thing == "mine"


def test_two_components_declaring_one_name_are_refused():
    with pytest.raises(ValueError, match="declared by both"):
        PlugRegistry(Owner(), Owner())


def test_before_restore_runs_with_the_names_being_put_back():
    owner, seen = Owner(), []
    with PlugRegistry(owner).plugged({"rule": round}, before_restore=seen.append):
        pass
    assert seen == [{"rule"}]


def test_the_allocator_plug_point_refuses_more_blocks_than_the_pool_holds():
    kv = KVCacheManager(8, 4)
    registry = PlugRegistry(kv)
    with pytest.raises(ValueError, match="the allocator has 9 blocks; the pool holds 8"):
        registry.swap({"block_allocator": BlockAllocator(9)})
    small = BlockAllocator(4)
    with registry.plugged({"block_allocator": small}):
        assert kv.allocator is small and kv.num_blocks == 4
    assert kv.num_blocks == 8


def test_options_are_validated_by_the_config_and_restored_as_a_whole():
    config = EngineConfig()
    options = RuntimeOptions(config)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer"):
        options.set(max_num_seqs=0)
    with pytest.raises(ValueError, match="cannot change while the engine lives"):
        options.set(block_size=8)
    before = (config.max_num_seqs, config.enable_chunked_prefill, config.long_prefill_token_threshold)
    with options.changed(max_num_seqs=3, enable_chunked_prefill=True):
        options.set(long_prefill_token_threshold=64)  # valid only with chunking: undone on exit too
        assert config.max_num_seqs == 3
    assert (config.max_num_seqs, config.enable_chunked_prefill, config.long_prefill_token_threshold) == before


def test_a_restore_goes_through_the_configs_own_checks():
    """The restore is ``dataclasses.replace`` (``EngineConfig.__post_init__`` runs), not a raw write of the old
    values: a configuration broken behind the options' back inside the block is reported on exit."""
    config = EngineConfig()
    options = RuntimeOptions(config)
    with pytest.raises(ValueError, match="block_size must be an integer"):
        with options.changed(max_num_seqs=3):
            config.block_size = 0  # written onto the shared object directly, past every check
    assert config.max_num_seqs == 3  # nothing written from a configuration that failed its checks
