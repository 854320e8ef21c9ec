"""Shared fixtures: the bundled model (float32, loaded once), its transformers twin, and
tiny randomly initialised Llama / Qwen2 folders built on the fly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported (its language's own jitted helpers
# are built then), and other tests' imports may import it first; without CUDA its kernel's
# tests run in the interpreter, so the session sets it before anything imports Triton.
# The engine calls the Triton kernel on CUDA devices only, so nothing else changes.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.models.loaded import LoadedModel  # noqa: E402

pytest_plugins = ["rss_log"]  # `--rss-log DIR` (tests/rss_log.py)

# `make test` and `make test-fast` run on one pytest-xdist worker per core: each worker's
# torch gets its share of the cores, as do the servers it starts (OMP_NUM_THREADS), so the
# workers' thread pools never spin against each other
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

# how far a worker that drives no browser steps back (see pytest_runtest_setup)
_OTHERS_NICENESS = 10
_NICED = False

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# the device tests run on; set BATCHLENS_TEST_DEVICE=cuda on a GPU machine
TEST_DEVICE = os.environ.get("BATCHLENS_TEST_DEVICE", "cpu")


MODEL_FIXTURES = frozenset({"loaded", "hf_model", "tokenizer_dir", "tiny_models"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that reads the bundled model's files, directly or through another fixture, is
    a `model` test even where its module forgot the mark: `make test-fast` never loads them.

    On pytest-xdist workers the browser tests come first, so their worker starts on them,
    then the files that run the model, which take longest, so no worker ends on one of them
    while the others are done."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)
        if (item.get_closest_marker("browser") is not None) != _in_browser_file(item.nodeid):
            raise pytest.UsageError(
                f"{item.nodeid}: browser tests, and only they, live in tests/ui/test_browser*.py"
                " (their pytest-xdist worker is chosen by file name)")
    if _WORKERS > 1:
        with_model = {item.path for item in items if item.get_closest_marker("model")}
        items.sort(key=lambda item: (not _in_browser_file(item.nodeid),
                                     item.path not in with_model))


def _in_browser_file(nodeid: str) -> bool:
    return Path(nodeid.split("::")[0]).name.startswith("test_browser")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, except that all the browser test files are one unit of work: one
    worker drives the browser tests one after another (and never two dashboards at once)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class BrowserFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "browser" if _in_browser_file(nodeid) else super()._split_scope(nodeid)

    return BrowserFilesTogether(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A worker's first test that drives no browser lowers its own priority (and its
    servers'), for good: the worker driving the browser tests then has the CPU it needs,
    since a page's every wait is on its own server's steps, and the others take the rest."""
    global _NICED
    if _WORKERS > 1 and not _NICED and not _in_browser_file(item.nodeid):
        os.nice(_OTHERS_NICENESS)
        _NICED = True


@pytest.fixture(scope="session")
def loaded() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct in float32 on CPU (real weights)."""
    return LoadedModel.load(None, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def hf_model(loaded: LoadedModel):
    """transformers' own implementation on the same weights, for reference outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(loaded.folder, dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, one prompt at a time, greedy, EOS ignored (not masked)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, pad_token_id=0, eos_token_id=None,
    )
    return out[0, len(prompt_ids):].tolist()


def build_tiny_model(kind: str, folder: Path, bundled: Path, head_dim: int = 16) -> Path:
    """Save a tiny randomly initialised Llama or Qwen2 (4 query heads, 2 kv heads of
    `head_dim`) with the bundled tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=4 * head_dim, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    # random init gives tiny logits; scale up so greedy choices are well separated
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (bundled / name).exists():
            shutil.copy(bundled / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """A folder with the bundled tokenizer's files ($BATCHLENS_TOKENIZER_DIR overrides)."""
    if os.environ.get("BATCHLENS_TOKENIZER_DIR"):
        return Path(os.environ["BATCHLENS_TOKENIZER_DIR"])
    from engine.models import loader

    return loader.hf_folder(loader.resolve_model(None))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, tokenizer_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: build_tiny_model(k, root / k, tokenizer_dir) for k in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def tiny_llama_d64(tmp_path_factory, tokenizer_dir: Path) -> Path:
    """A tiny Llama with head_dim 64: a shape the attention kernel's tile path takes."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny_d64"), tokenizer_dir, 64)


# ---- the two serving sides on the shared float32 weights, one of each per test module -------
@pytest.fixture(scope="module")
def engine(loaded):
    """A small datacenter engine (64 KV blocks) on the shared float32 loaded."""
    from engine import Engine, EngineConfig

    with Engine(EngineConfig(num_kv_blocks=64), loaded=loaded) as eng:
        yield eng


@pytest.fixture(scope="module")
def local(loaded):
    """A local PC with a 512-token window on the shared float32 model."""
    from engine.local import LocalPC

    with LocalPC(loaded, n_ctx=512) as local_pc:
        yield local_pc

