"""`batchlens bench --llamacpp` for real (`make compat`): llama.cpp's llama-bench and
llama-batched-bench, built by scripts/build_llama_server.sh, on the bf16 GGUF it converts
from the engine's own safetensors folder, beside a short engine bench in the same run.
It prints the side-by-side table (pytest -s shows it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import THREADS

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^(llama-bench tg128|llama-bench pp512|batched-bench \d+)"
                 r"(?: \(batch 1\)| seqs decode)?"
                 r"\s+([\d.]+)\s+engine@\d+ \w+\s+([\d.]+)\s+([\d.]+)x$", re.MULTILINE)


def test_bench_llamacpp_prints_llama_cpp_beside_the_engine(llama_binary):
    cmd = [sys.executable, "-m", "batchlens.cli", "bench", "--llamacpp", "--quick",
           "--only", "engine", "--requests", "8", "--concurrency", "1,4",
           "--threads", str(THREADS)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = ROW.findall(done.stdout)
    assert [r[0] for r in rows] == [
        "llama-bench tg128", "llama-bench pp512", "batched-bench 1", "batched-bench 4"]
    for _, theirs, ours, ratio in rows:
        assert float(theirs) > 0 and float(ours) > 0
        assert float(ratio) == pytest.approx(float(ours) / float(theirs), abs=0.01)
    assert f".bf16.gguf, {THREADS} threads" in done.stdout
