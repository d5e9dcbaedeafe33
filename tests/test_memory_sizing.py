"""Memory: the default KV pool's size on a GPU (``gpu_memory_utilization``, read through a fake device
memory figure), ``shutdown()`` and garbage collection returning an engine's memory, and engines of one
model sharing one copy of its weights. CPU only, small pools."""
import dataclasses
import gc
import os
import shutil
import weakref

import pytest
import torch

from labsupport import LLM, SamplingParams
from labsupport.engine import build
from labsupport.engine.config import EngineConfig, gpu_kv_cache_bytes
from labsupport.kernels import products, select
from labsupport.models import llama, loader

GiB = 2**30
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("value", [0, -0.1, 1.01, 2, "0.5", None, True])
def test_gpu_memory_utilization_must_be_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)


@pytest.mark.parametrize("value", [0.05, 0.2, 1, 1.0])
def test_gpu_memory_utilization_accepts_a_fraction(value):
    assert EngineConfig(gpu_memory_utilization=value).gpu_memory_utilization == value


@pytest.fixture
def fake_gpu(llm, monkeypatch):
    """The session engine, sized as if on a GPU whose memory figures the test sets: ``fake_gpu(free, total,
    **options)`` -> the default number of blocks (or the ValueError)."""
    engine = llm.engine
    dtype = next(engine.model.parameters()).dtype
    config = engine.config

    def blocks(free, total, **options):  # only the sizing runs "on the GPU"
        monkeypatch.setattr(build, "device_memory", lambda device: (free, total))
        return build.blocks_in_budget(dataclasses.replace(config, **options), [engine.model],
                                      torch.device("cuda"), dtype)

    blocks.per_block = engine.backend.pool_bytes // engine.kv.num_blocks
    blocks.weights = sum(t.numel() * t.element_size() for t in engine.model.parameters())
    return blocks


def test_default_pool_is_the_share_of_total_memory_less_weights(fake_gpu):
    n = fake_gpu(60 * GiB, 80 * GiB)  # default utilization 0.2: 16 GiB of the 80, whatever is free
    share = int(0.2 * 80 * GiB)
    kv = n * fake_gpu.per_block
    assert share - fake_gpu.weights - GiB < kv <= share - fake_gpu.weights  # the activation reserve is small
    assert fake_gpu(60 * GiB, 80 * GiB, gpu_memory_utilization=0.1) < n / 2  # half the share, less than half the KV
    assert fake_gpu(20 * GiB, 80 * GiB) == n  # a fraction of *total* memory: free memory does not change it


def test_several_engines_share_one_gpu_until_it_is_full(fake_gpu):
    """80 GiB device, 20 GiB held by another process: engines of 0.2 each fit three times, not four."""
    free, sizes = 60 * GiB, []
    for _ in range(3):
        sizes.append(fake_gpu(free, 80 * GiB))
        free -= int(0.2 * 80 * GiB)  # what the engine then holds: weights, KV pool and reserve
    assert len(set(sizes)) == 1
    with pytest.raises(ValueError, match=r"free.*gpu_memory_utilization.*shutdown"):
        fake_gpu(free, 80 * GiB)
    assert fake_gpu(free, 80 * GiB, gpu_memory_utilization=0.1) > 0  # a smaller share still fits


def test_explicit_kv_bytes_and_num_blocks_win(fake_gpu):
    assert fake_gpu(60 * GiB, 80 * GiB, kv_cache_memory_bytes=10 * fake_gpu.per_block) == 10
    # num_blocks wins over both: the engine does not even ask for a budget
    small = LLM(device="cpu", num_blocks=3, gpu_memory_utilization=0.01)
    assert small.engine.kv.num_blocks == 3
    small.shutdown()


def test_a_budget_too_small_says_which_option_to_change(fake_gpu):
    with pytest.raises(ValueError, match=r"weights.*nothing is left.*Raise gpu_memory_utilization"):
        fake_gpu(GiB, GiB)  # 0.2 GiB cannot hold the weights
    # a share that holds the weights and the reserve but not one max_model_len sequence
    big = 1000 * GiB
    reserve = int(0.2 * big) - fake_gpu.weights - fake_gpu(big, big) * fake_gpu.per_block  # within one block
    max_len = 8192
    one_seq = -(-max_len // 16) * fake_gpu.per_block
    total = int((fake_gpu.weights + reserve + one_seq // 2) / 0.2)
    with pytest.raises(ValueError, match=r"max_model_len=8192.*Raise gpu_memory_utilization or lower max_model_len"):
        fake_gpu(total, total, max_model_len=max_len)
    assert fake_gpu(total, total, max_model_len=max_len // 4) > 0  # a shorter max_model_len fits


def test_the_rule_itself_with_a_made_up_model():
    from labsupport.models.llama import ModelConfig

    model = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16)
    c = EngineConfig(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, gpu_memory_utilization=0.5)
    reserve = 4 * (256 * (2 * 64 + 2 * 128 + 8 * 16) + 4 * 1000)
    assert gpu_kv_cache_bytes(c, model, 100, 512, free=2000 * GiB, total=10 * GiB) == 5 * GiB - 100 - reserve
    with pytest.raises(ValueError, match="only 1.00 GiB of the device is free"):
        gpu_kv_cache_bytes(c, model, 100, 512, free=GiB, total=10 * GiB)


H200 = 143771 * 2**20  # what the course's GPU machine reports


def test_four_default_engines_fit_an_h200_beside_its_cuda_context(fake_gpu):
    """Chapter 09 holds four engines of the default share at once (plain, speculative, then the sweep's two)."""
    free, sizes = H200 - 2 * GiB, []  # the kernel's CUDA context and the weights' first copy
    for _ in range(4):
        sizes.append(fake_gpu(free, H200))
        free -= int(0.2 * H200)
    assert len(set(sizes)) == 1 and sizes[0] * fake_gpu.per_block > 25 * GiB
    with pytest.raises(ValueError, match="shutdown"):
        fake_gpu(free, H200)  # a fifth is refused with the way out, not an out-of-memory error mid-step


def test_memory_the_allocator_keeps_from_a_dropped_engine_counts_as_free(monkeypatch):
    """The driver counts PyTorch's cached blocks as used; the next engine's pool is carved out of them."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * GiB)
    assert loader.device_memory("cuda:0") == (36 * GiB, 80 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 30 * GiB)
    assert loader.device_memory("cuda:0") == (10 * GiB, 80 * GiB)


def test_device_memory_reads_the_machine_on_cpu():
    free, total = loader.device_memory("cpu")
    assert 0 < free <= total


# ---------------------------------------------------------------------------- shutdown and gc


def test_shutdown_frees_the_pool_and_refuses_more_work():
    llm = LLM(device="cpu", num_blocks=8, enable_prefix_caching=True, cpu_offload_blocks=4)
    engine = llm.engine
    pools = [weakref.ref(t) for t in engine.backend.k_pool[:2] + engine.backend.v_pool[:2]]
    tier = weakref.ref(engine.kv.cpu_tier.host_k[0])
    model = weakref.ref(engine.model)
    req = engine.add_request(list(range(100, 120)), GREEDY)
    engine.step()
    llm.shutdown()
    assert req.is_finished and req.finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.kv.allocator.num_free == 8
    gc.collect()
    assert all(r() is None for r in pools) and tier() is None
    assert engine.model is None and model() is None  # its module goes; shared weight tensors stay for others
    llm.shutdown()  # idempotent
    for call in (lambda: llm.generate("Hello", GREEDY, use_tqdm=False),
                 lambda: engine.add_request([1, 2, 3], GREEDY),
                 lambda: engine.step()):
        with pytest.raises(RuntimeError, match="shut down; create a new LLM"):
            call()


def test_shutdown_of_a_contiguous_engine_frees_its_caches():
    llm = LLM(device="cpu", kv_cache="contiguous")
    llm.engine.add_request(list(range(100, 120)), GREEDY)
    llm.engine.step()
    cache = weakref.ref(next(iter(llm.engine.kv.caches.values()))[0][0])
    llm.shutdown()
    gc.collect()
    assert cache() is None


def _engine_refs(**options):
    llm = LLM(device="cpu", num_blocks=8, **options)
    llm.generate(["The capital of France is", "1, 2, 3,"], GREEDY, use_tqdm=False)
    return weakref.ref(llm), weakref.ref(llm.engine), weakref.ref(llm.engine.backend.k_pool[0])


@pytest.mark.parametrize("options", [{}, {"enable_prefix_caching": True, "enable_result_cache": True}])
def test_an_llm_out_of_scope_is_freed(options):
    gc.collect()
    refs = _engine_refs(**options)
    gc.collect()
    assert all(r() is None for r in refs), "something still refers to the dropped engine or its pool"


def test_an_llm_out_of_scope_is_freed_without_the_cycle_collector():
    """No reference cycle: dropping the last reference frees the engine at once (a cycle would keep
    its memory until the cycle collector happens to run)."""
    gc.collect()
    gc.disable()
    try:
        llm = LLM(device="cpu", num_blocks=8)
        refs = weakref.ref(llm.engine), weakref.ref(llm.engine.backend.k_pool[0]), weakref.ref(llm.engine.model)
        del llm
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()


# ---------------------------------------------------------------------------- shared weights


def test_engines_of_one_model_share_weights_and_survive_each_other(llm):
    other = LLM(device="cpu", num_blocks=16)
    mine, theirs = dict(llm.engine.model.named_parameters()), dict(other.engine.model.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(mine[k].data_ptr() == theirs[k].data_ptr() for k in mine)
    assert llm.engine.model is not other.engine.model  # one module each: only the tensors are shared
    prompts = ["The capital of France is", "def fibonacci(n):"]
    before = [o.token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)]
    assert before == [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    other.shutdown()
    gc.collect()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
    assert all(p.data_ptr() == mine[k].data_ptr() for k, p in llm.engine.model.named_parameters())


def test_another_dtype_gets_its_own_copy(llm):
    half = LLM(device="cpu", dtype="bfloat16", num_blocks=4)
    p = half.engine.model.model.embed_tokens.weight
    assert p.dtype == torch.bfloat16
    assert p.data_ptr() != llm.engine.model.model.embed_tokens.weight.data_ptr()
    half.shutdown()


@pytest.fixture
def tiny_folder(tmp_path, llm):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llm.engine.model_path / name, tmp_path / name)
    return tmp_path


def test_shared_weights_go_with_the_last_engine_and_a_rewritten_checkpoint_reloads(tiny_folder):
    a, b = LLM(model=str(tiny_folder), device="cpu", num_blocks=4), LLM(model=str(tiny_folder), device="cpu", num_blocks=4)
    weights = weakref.ref(a.engine.model.shared_weights)
    assert b.engine.model.shared_weights is weights()
    a.shutdown()
    del a
    gc.collect()
    assert weights() is not None  # b still uses them
    del b
    gc.collect()
    assert weights() is None and not any(k[0] == str(tiny_folder.resolve()) for k in loader._WEIGHTS.keys())
    c = LLM(model=str(tiny_folder), device="cpu", num_blocks=4)
    import transformers
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(tiny_folder)).save_pretrained(tiny_folder)
    d = LLM(model=str(tiny_folder), device="cpu", num_blocks=4)
    assert d.engine.model.shared_weights is not c.engine.model.shared_weights  # new checkpoint, new weights


needs_onednn = pytest.mark.skipif(products._onednn_linear is None, reason="oneDNN packing is used on x86 CPUs only")


@needs_onednn
def test_engines_of_one_model_share_its_packed_cpu_weights(tiny_folder):
    a, b = LLM(model=str(tiny_folder), device="cpu", num_blocks=4), LLM(model=str(tiny_folder), device="cpu", num_blocks=4)
    pa, pb = a.engine.model.model.layers[0].mlp.gate_up_packed, b.engine.model.model.layers[0].mlp.gate_up_packed
    assert pa is not None and pa[0] is pb[0]  # one packed copy per process, not one per engine
    assert set(a.engine.model.shared_weights.packed) >= {"lm_head", "model.layers.1.self_attn.qkv",
                                                         "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_up"}


@needs_onednn
def test_a_packed_linear_equals_the_plain_one_and_notices_a_rewritten_weight():
    torch.manual_seed(0)
    m = llama.Linear(48, 80, bias=True)
    products.pack_cpu_weights(torch.nn.Sequential(m), {})
    llama.use_kernels(m, select.cpu())
    for rows in (1, 5, 70, 300):  # decode- and prefill-sized
        x = torch.randn(rows, 48)
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        m.weight.mul_(2)  # written in place: the packed copy is stale and must not be used
    x = torch.randn(3, 48)
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    m.weight = torch.nn.Parameter(torch.randn(80, 48))  # replaced
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)


def test_stacked_projections_equal_the_separate_ones_and_notice_a_replaced_weight():
    """q/k/v and gate/up are one (packed) product each; a module whose weight is replaced afterwards goes
    back to its own product, so the stale stack is never read."""
    model = loader.random_model(loader.RANDOM_MODELS["tiny"], "cpu", torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv is not None and mlp.gate_up is not None
    x = torch.randn(7, attn.q_proj.in_features)

    def separate_mlp(x):
        return mlp.down_proj(torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T))
    torch.testing.assert_close(mlp(x), separate_mlp(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # written in place, through the view: the stack holds it too
    torch.testing.assert_close(mlp(x), separate_mlp(x), rtol=1e-5, atol=1e-5)
    mlp.gate_proj.weight = torch.nn.Parameter(torch.randn_like(mlp.gate_proj.weight))  # replaced: not in the stack
    assert not llama.stacked_current((mlp.gate_up, None), mlp.gate_proj, mlp.up_proj)
    torch.testing.assert_close(mlp(x), separate_mlp(x), rtol=1e-5, atol=1e-5)
    assert llama.stacked_current(attn.qkv, attn.q_proj, attn.k_proj, attn.v_proj)
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())
    assert not llama.stacked_current(attn.qkv, attn.q_proj, attn.k_proj, attn.v_proj)


# ---------------------------------------------------------------------------- the CPU weights file


@pytest.fixture
def model_copy(llm, tmp_path):
    """The default model's folder under another name (hard links where the file system allows): a checkpoint
    no live engine of this process holds, so loading it reads the files again."""
    import os
    folder = tmp_path / "smol-copy"
    folder.mkdir()
    for f in llm.engine.model_path.iterdir():
        try:
            os.link(f, folder / f.name)
        except OSError:
            shutil.copy(f, folder / f.name)
    return folder


def test_the_cpu_weights_file_is_mapped_and_an_unwritable_cache_falls_back(llm, model_copy, tmp_path, monkeypatch):
    from labsupport.models import cpu_weights
    assert llm.engine.model.shared_weights.mapped is not None  # the session's engine maps the shared file
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    not_a_folder = tmp_path / "a-file"  # where the cache's folder should be (unwritable even for root)
    not_a_folder.write_text("")
    monkeypatch.setattr(cpu_weights, "cache_file", lambda cache, folder, key: not_a_folder / f"{key}.pt")
    other = LLM(model=str(model_copy), device="cpu", num_blocks=16)  # cannot write the file: loads as before
    assert other.engine.model.shared_weights.mapped is None
    assert [o.token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)] == want


def test_the_first_engine_writes_the_cpu_weights_file_and_maps_it_with_the_same_tokens(llm, model_copy, tmp_path,
                                                                                       monkeypatch):
    from labsupport.models import cpu_weights
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    cache = tmp_path / "cache"
    monkeypatch.setattr(cpu_weights, "cache_file", lambda cache_dir, folder, key: cache / f"{key}.pt")
    other = LLM(model=str(model_copy), device="cpu", num_blocks=16)
    assert other.engine.model.shared_weights.mapped.parent == cache  # built, saved, then mapped like every later one
    assert [o.token_ids for o in other.generate(prompts, GREEDY, use_tqdm=False)] == want
    if os.path.exists("/proc/self/maps"):  # the stacks and panels are the file's pages, not copies made here
        path = str(other.engine.model.shared_weights.mapped)
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in open("/proc/self/maps") if path in line]
        layer = other.engine.model.model.layers[0]
        for t in (layer.self_attn.qkv[0], layer.mlp.gate_up, layer.mlp.gate_up_packed[0]):
            assert any(lo <= t.data_ptr() < hi for lo, hi in spans)
    other.shutdown()
