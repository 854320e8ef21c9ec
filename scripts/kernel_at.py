"""One native kernel source as it is at a git revision, built beside the current build
for an A/B timing (`kernel_bench.py --against`, `bf16_matmul_bench.py --against`)."""

from __future__ import annotations

import hashlib
import re
import subprocess
from pathlib import Path

from engine.models import loader, native

ROOT = Path(__file__).resolve().parents[1]
CSRC = "engine/models/csrc"
HEADERS = ("simd.h", "kernels.h")
# sources a source calls into (paged_attention.cpp asks bf16_gemm.cpp for the tile state)
NEEDS = {"paged_attention.cpp": ("bf16_gemm.cpp",)}


def source_at(rev: str, name: str) -> str:
    """csrc/`name` as it is at git revision `rev`."""
    return subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def build_at(rev: str, source: str) -> None:
    """Build csrc/`source` as it is at git revision `rev`, its ops registered under
    torch.ops.batchlens_ab (built once per source into the kernel cache)."""
    from torch.utils.cpp_extension import load

    sources = (source, *NEEDS.get(source, ()))
    src = {name: source_at(rev, name) for name in (*sources, *HEADERS)}
    # its own op namespace and C++ namespace, so neither clashes with the current build's
    for name in (*sources, "kernels.h"):
        text = re.sub(r"TORCH_LIBRARY(\w*)\(batchlens,", r"TORCH_LIBRARY\1(batchlens_ab,",
                      src[name])
        src[name] = (text.replace("namespace batchlens ", "namespace batchlens_ab ")
                     .replace("batchlens::", "batchlens_ab::"))
    key = hashlib.sha256("".join(src.values()).encode() + " ".join(native.cflags()).encode()
                         ).hexdigest()[:16]
    folder = loader.cache_root() / "kernels" / f"ab-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in src.items():
        (folder / name).write_text(text)
    load(name=f"batchlens_ab_{key}", sources=[str(folder / name) for name in sources],
         extra_cflags=native.cflags(), build_directory=str(folder), is_python_module=False)
