"""CUDA-graph decode (``kernels/cuda_graphs.py``), checked on the CPU: ``capture=False`` runs the very
forward a graph would record, from the static buffers, so a wrong slot, table row or padding row
shows here as a different logit or token. The graphs themselves are checked by ``make gpu-check``."""
import random
from types import SimpleNamespace

import pytest
import torch

from labsupport import LLM, SamplingParams
from labsupport.kernels.cuda_graphs import DecodeGraphs, capture_sizes
from labsupport.engine.paged_attention import PagedAttention
from labsupport.engine.runner import ModelRunner
from labsupport.engine.scheduler import SchedulerOutput
from labsupport.models.loader import RANDOM_MODELS, random_model

BS = 4


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(5) == [1, 2, 4, 5] and capture_sizes(1) == [1]
    for m in (1, 3, 17, 64):
        assert all(any(s >= b for s in capture_sizes(m)) for b in range(1, m + 1))


def test_graphs_need_a_scratch_block():
    cfg = RANDOM_MODELS["tiny"]
    backend = PagedAttention(cfg.num_layers, 8, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="scratch"):
        DecodeGraphs(random_model(cfg, "cpu", torch.float32), backend, 4, 64, capture=False)


@pytest.mark.parametrize("lens", [[5], [1, 9, 4], [17, 3, 8, 12, 30]])  # batch 3 and 5 run padded buckets 4 and 8
def test_static_buffer_forward_equals_the_eager_step(lens):
    cfg = RANDOM_MODELS["tiny"]
    model = random_model(cfg, "cpu", torch.float32)
    num_blocks = sum(-(-n // BS) for n in lens) + 4
    backend = PagedAttention(cfg.num_layers, num_blocks, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                             scratch_block=True)
    for pool in backend.k_pool + backend.v_pool:  # old KV everywhere, the scratch block too: masking must hold
        pool.normal_()
    blocks = iter(random.Random(0).sample(range(num_blocks), num_blocks))
    requests = [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=n - 1, num_tokens=n,
                                all_token_ids=[(7 * i + j) % cfg.vocab_size for j in range(n)],
                                block_table=[next(blocks) for _ in range(-(-n // BS))],
                                params=SimpleNamespace(greedy=True)) for i, n in enumerate(lens)]
    step = SchedulerOutput(requests=requests, num_new_tokens=[1] * len(lens))
    graphs = DecodeGraphs(model, backend, max_batch=8, max_model_len=64, capture=False)
    assert graphs.can_run(step)
    with torch.inference_mode():
        static = graphs.run(step).clone()
        runner = ModelRunner(model, backend, "cpu")
        meta = backend.prepare(requests, [1] * len(lens))
        ids = torch.tensor([r.all_token_ids[-1] for r in requests])
        pos = torch.tensor([r.num_computed_tokens for r in requests])
        eager = model.logits(runner.model(ids, pos, backend, meta))
    assert static.shape == eager.shape
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    scratch = slice(backend.scratch_slot, backend.scratch_slot + BS)
    assert all(pool[:, :backend.scratch_slot].isfinite().all() for pool in backend.k_pool)
    assert backend.k_pool[0][:, scratch].shape[1] == BS


def test_engine_with_graph_decode_makes_the_same_tokens():
    """Mixed steps (prefills eager, decodes through the static buffers), batches growing and shrinking."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 3, 7, 1, 9)]
    prompts = [[(5 * i + j) % 500 + 1 for j in range(3 + 4 * i)] for i in range(5)]
    plain = LLM(model="random:tiny", device="cpu", num_blocks=64, block_size=BS, max_num_seqs=4)
    want = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = LLM(model="random:tiny", device="cpu", num_blocks=64, block_size=BS, max_num_seqs=4)
    engine, cfg = llm.engine, llm.engine.model.config
    backend = PagedAttention(cfg.num_layers, 64, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                             scratch_block=True)
    graphs = DecodeGraphs(engine.model, backend, 4, engine.max_model_len, capture=False)
    engine.backend, engine.runner = backend, ModelRunner(engine.model, backend, engine.device, executor=graphs)
    calls = []
    run = graphs.run
    graphs.run = lambda batch: calls.append(len(batch.requests)) or run(batch)
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got == want
    assert calls and max(calls) > 1  # decode steps did go through the graph path, batched
    assert engine.kv.allocator.num_free == 64


@pytest.mark.parametrize("spec", ["random:tiny", "random:tiny-qwen3", "qwen2-bias"])
def test_stacked_projections_give_the_same_logits_and_share_memory(spec):
    """``fuse_projections`` (used on GPUs) stacks q/k/v and gate/up: same logits, no extra copy of the weights."""
    from labsupport.engine.runner import sequence_logits
    from labsupport.models.llama import fuse_projections
    from labsupport.models.loader import random_config

    import dataclasses
    cfg = (dataclasses.replace(random_config("random:tiny"), attention_bias=True, model_type="qwen2")
           if spec == "qwen2-bias" else random_config(spec))
    model = random_model(cfg, "cpu", torch.float32)
    ids = list(range(3, 40))
    want = sequence_logits(model, ids)
    before = sum(p.numel() for p in model.parameters())
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    assert attn.qkv is not None and attn.q_proj.weight.data_ptr() == attn.qkv[0].data_ptr()  # a view, not a copy
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.qkv[0].untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before
    torch.testing.assert_close(sequence_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    if cfg.attention_bias:
        assert attn.qkv[1] is not None and attn.v_proj.bias.data_ptr() > attn.qkv[1].data_ptr()
    other = random_model(cfg, "cpu", torch.float32)  # a second model over the same tensors
    other.load_state_dict(model.state_dict(keep_vars=True), assign=True)
    fuse_projections(other)
    assert other.model.layers[1].mlp.gate_up.data_ptr() == model.model.layers[1].mlp.gate_up.data_ptr()


# ---- graphs recorded ahead of time, and following max_num_seqs (issue 52, items 3 and 4) ----------------------

def _recording_graphs(monkeypatch, max_batch, config=None):
    """A ``DecodeGraphs`` that records (``capture=True``) with the recording itself replaced by a note of the bucket
    and of the thread that recorded it: on the CPU everything around a CUDA capture runs for real."""
    import threading
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    recorded = []

    def record(self, size):
        recorded.append((size, threading.current_thread().name, self.max_batch))
        self.graphs[size] = SimpleNamespace(replay=lambda: None)
        self.logits[size] = self._forward(size)
        self.captured.append(size)

    monkeypatch.setattr(DecodeGraphs, "_capture", record)
    cfg = RANDOM_MODELS["tiny"]
    model = random_model(cfg, "cpu", torch.float32)
    backend = PagedAttention(cfg.num_layers, 32, BS, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                             scratch_block=True)
    return model, backend, recorded


def test_the_engine_build_records_every_bucket_before_it_serves(monkeypatch):
    from labsupport.engine import build
    from labsupport.engine.config import EngineConfig
    model, backend, recorded = _recording_graphs(monkeypatch, 24)
    config = EngineConfig(max_num_seqs=24, max_model_len=64, num_blocks=32, block_size=BS)
    graphs = build.step_executor(config, model, backend, "cpu")
    assert isinstance(graphs, DecodeGraphs) and [size for size, _, _ in recorded] == capture_sizes(24)
    assert graphs.config is config  # the live config: a raised max_num_seqs reaches the graphs
    scratch = backend.scratch_slot
    assert all(row == scratch for row in graphs.slots.tolist())  # recorded on padding: no live block written
    step = SchedulerOutput(requests=_decode_requests([5, 9, 3]), num_new_tokens=[1, 1, 1])
    assert graphs.can_run(step)
    graphs.run(step)
    assert len(recorded) == len(capture_sizes(24))  # a step records nothing more


def test_raising_max_num_seqs_records_every_bucket_again_when_it_changes(monkeypatch):
    from labsupport.engine import build
    from labsupport.engine.config import EngineConfig
    from labsupport.engine.plug_points import RuntimeOptions
    model, backend, recorded = _recording_graphs(monkeypatch, 3)
    config = EngineConfig(max_num_seqs=3, max_model_len=64, num_blocks=32, block_size=BS)
    graphs = build.step_executor(config, model, backend, "cpu")
    options = RuntimeOptions(config)
    options.watch(build.follow_options(graphs))
    recorded.clear()
    with options.changed(max_num_seqs=16):
        assert graphs.max_batch == 16 and [size for size, _, _ in recorded] == capture_sizes(16)
        assert all(batch == 16 for _, _, batch in recorded)  # recorded on the new, larger buffers
        step = SchedulerOutput(requests=_decode_requests([5, 9, 3, 17, 4, 8, 2, 30, 11]), num_new_tokens=[1] * 9)
        assert graphs.can_run(step)  # 9 rows: a graph, not a silent eager step
    assert graphs.max_batch == 16  # lowering it back keeps the larger graphs (a bucket above the batch is padding)
    assert build.follow_options(object()) is None  # an executor no option sizes is not watched


def test_graphs_not_told_of_a_raise_catch_up_before_the_larger_step(monkeypatch):
    """Without the engine's watch (an engine built before it, a config changed by hand), the first step of a
    larger batch records the buckets, then replays: never an eager step for want of a graph."""
    from labsupport.engine.config import EngineConfig
    from labsupport.engine.plug_points import RuntimeOptions
    model, backend, recorded = _recording_graphs(monkeypatch, 2)
    config = EngineConfig(max_num_seqs=2, max_model_len=64, num_blocks=32, block_size=BS)
    graphs = DecodeGraphs(model, backend, 2, 64, config=config)
    RuntimeOptions(config).set(max_num_seqs=6)
    lens = [5, 9, 3, 17, 4]
    step = SchedulerOutput(requests=_decode_requests(lens), num_new_tokens=[1] * len(lens))
    with torch.inference_mode():
        logits = graphs.decode_logits(step)
    assert logits is not None and logits.shape[0] == len(lens) and graphs.max_batch == 6
    assert [size for size, _, _ in recorded] == capture_sizes(6)


def test_graphs_step_aside_for_a_connector_that_runs_code_inside_the_forward(monkeypatch):
    from labsupport.pd.connector import TcpConnector
    model, backend, _ = _recording_graphs(monkeypatch, 4)
    graphs = DecodeGraphs(model, backend, 4, 64, capture=False)
    step = SchedulerOutput(requests=_decode_requests([5, 9]), num_new_tokens=[1, 1])

    class Pushes(TcpConnector):  # a connector that sends each layer as it is written, inside the forward
        def save_kv_layer(self, layer, k_pool, v_pool, attn_metadata):
            pass

    # made without __init__ (no server): only their classes' hooks matter here
    for connector, replays in ((None, True), (TcpConnector.__new__(TcpConnector), True),
                               (Pushes.__new__(Pushes), False)):
        backend.connector = connector
        assert graphs.can_run(step) is replays


def _decode_requests(lens):
    cfg = RANDOM_MODELS["tiny"]
    blocks = iter(random.Random(1).sample(range(32), 32))
    return [SimpleNamespace(request_id=f"r{i}", num_computed_tokens=n - 1, num_tokens=n,
                            all_token_ids=[(3 * i + j) % cfg.vocab_size for j in range(n)],
                            block_table=[next(blocks) for _ in range(-(-n // BS))], params=SimpleNamespace(greedy=True))
            for i, n in enumerate(lens)]
