"""The host-overhead bench without a model: the real engine loop over `InstantModel`."""

from __future__ import annotations

import json
import math

import torch

from measure.bench import host
from measure.bench.cli import parse_args


class FakeTokenizer:
    """Stand-in tokenizer: token i decodes to "<i>"."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_instant_model_returns_logits_of_the_sampled_rows():
    model = host.InstantModel(torch.device("cpu"), torch.float32, max_rows=8)
    logits = model.forward(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long),
                           None, [], torch.arange(3))  # type: ignore[arg-type]
    assert logits.shape == (3, host.LOGITS_WIDTH) and logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [256, 293, 266]  # 256 + 37 x row mod 64
    assert model.arch.num_layers == 0 and model.arch.num_kv_heads == 3


def test_host_bench_json_shape_and_figures(tmp_path):
    loaded = host.instant_loaded(FakeTokenizer(), torch.device("cpu"), torch.float32)
    result = host.run_host_bench(loaded, sizes=(1, 4), steps=3, repeats=2)
    host.check_figures(result)
    assert set(result["host_ms_per_step"]) == {"1", "4"}
    for n in ("1", "4"):
        ms = result["host_ms_per_step"][n]
        assert math.isfinite(ms) and ms > 0
        assert math.isclose(result["host_us_per_seq"][n], 1000 * ms / int(n), rel_tol=1e-3)
        assert len(result["windows_ms"][n]) == 2 and result["windows_ms"][n][0] == ms
        assert math.isfinite(result["cpu_ms_per_step"][n]) and result["cpu_ms_per_step"][n] > 0
    assert result["best_of"] == 2 and result["steps_per_window"] == 3
    json.loads(json.dumps(result))  # JSON-ready as saved
    table = host.format_host(result)
    assert table.splitlines()[1].split() == ["running", "ms/step", "us/seq", "cpu", "ms/step"]
    assert table.splitlines()[3].split()[0] == "4"


def test_host_overhead_flag_and_sizes():
    a = parse_args(["--host-overhead", "--concurrency", "1,2048"])
    assert a.host_overhead and a.host_sizes == [1, 2048]
    assert not parse_args([]).host_overhead
