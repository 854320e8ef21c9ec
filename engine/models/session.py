"""A loaded model: weights on a device, its tokenizer, and prompt encoding.

One `ModelSession` can be shared by the engine and the local runner so both sides run
the very same weights and math.
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine import compute
from engine.calibrate import device_name
from engine.models import loader, native
from engine.models.llama import LlamaModel

# A prompt: text, token ids, or a chat (list of {"role", "content"} messages).
Prompt = str | list[int] | list[dict[str, str]]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def _time_matmul(device: torch.device, dtype: torch.dtype, m: int = 64, k: int = 576,
                 n: int = 1536, reps: int = 20) -> float:
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)
    for _ in range(3):
        F.linear(x, w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / reps


def pick_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in and why. On a CPU, "auto" measures float32 against bfloat16 on
    the first start and keeps the answer per machine (CPU model, threads, torch version),
    so every later start runs the same dtype and prints the same text."""
    if dtype != "auto":
        return DTYPES[dtype], f"{dtype}: chosen in the settings"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bfloat16: native on this GPU"
        return torch.float16, "float16: this GPU has no bfloat16"
    machine = f"{device_name('cpu')}|torch {torch.__version__}"
    path = loader.cache_root() / "dtype" / f"{hashlib.sha256(machine.encode()).hexdigest()[:16]}.json"
    try:
        saved = json.loads(path.read_text())
        return DTYPES[saved["dtype"]], saved["reason"]
    except (OSError, ValueError, KeyError):
        pass
    picked, reason = _measure_cpu_dtype(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"machine": machine, "dtype": str(picked).split(".")[-1],
                                    "reason": f"{reason}, measured on the first start"}))
    except OSError:
        pass  # a read-only cache: measure again next start
    return picked, reason


def _measure_cpu_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    # interleaved, best of 5 each: robust to another process taking the cores for a moment
    t32 = t16 = float("inf")
    for _ in range(5):
        t32 = min(t32, _time_matmul(device, torch.float32))
        t16 = min(t16, _time_matmul(device, torch.bfloat16))
    if t16 < t32:
        return torch.bfloat16, f"bfloat16: matmul {t32 / t16:.1f}x faster than float32 here"
    return torch.float32, f"float32: bfloat16 matmul is {t16 / t32:.1f}x slower here"


@dataclass
class ModelSession:
    name: str
    folder: Path
    model: LlamaModel
    tokenizer: Any
    dtype_reason: str
    eos_token_ids: frozenset[int]

    @classmethod
    def load(
        cls, model: str | None = None, device: str = "auto", dtype: str = "auto"
    ) -> ModelSession:
        """Resolve, convert if needed (GGUF, once), and load a model (on the compute thread)."""
        session = compute.run(cls._load, model, device, dtype)
        freeze_heap()
        return session

    @classmethod
    def _load(cls, model: str | None, device: str, dtype: str) -> ModelSession:
        source = loader.resolve_model(model)
        folder = loader.hf_folder(source)
        dev = pick_device(device)
        torch_dtype, reason = pick_dtype(dtype, dev)
        llama = LlamaModel.from_folder(folder, dev, torch_dtype)
        native.paged_decode(dev, torch_dtype)  # build the CPU kernel now, not at the first step
        tok = loader.load_tokenizer(folder)
        eos = set()
        if tok.eos_token_id is not None:
            eos.add(int(tok.eos_token_id))
        cfg_eos = loader.read_config(folder).get("eos_token_id")
        if isinstance(cfg_eos, int):
            eos.add(cfg_eos)
        elif isinstance(cfg_eos, list):
            eos.update(int(e) for e in cfg_eos)
        return cls(source.name, folder, llama, tok, reason, frozenset(eos))

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; a chat gets the model's chat template."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt must not be empty")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, list | tuple):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if all(isinstance(t, int) for t in prompt):
                vocab = self.model.spec.vocab_size
                if any(t < 0 or t >= vocab for t in prompt):
                    raise ValueError(f"prompt: token ids must be in [0, {vocab})")
                return list(prompt)
            if all(isinstance(m, dict) for m in prompt):
                if not any(str(m.get("content", "")).strip() for m in prompt):
                    raise ValueError("prompt must not be empty")
                ids = self.tokenizer.apply_chat_template(
                    list(prompt), add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                return list(ids)
        raise ValueError("prompt must be a string, a list of token ids or a list of messages")

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def freeze_heap() -> None:
    """Move every object alive now (weights, tokenizer, imported libraries) out of the
    garbage collector's reach. Otherwise each full collection walks that whole heap while
    the engine's step loop waits: measured on the 2-core CPU with transformers' model also
    loaded, decode steps of 24 ms were 63 ms on average, with pauses up to 1.7 s."""
    gc.collect()
    gc.freeze()
