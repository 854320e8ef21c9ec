"""The padded decode path, the one CUDA graphs replay: decode-only steps in fixed buffers.

A decode-only step of S requests runs as a batch padded up to the next of `padded_sizes`
(1, 2, 4, 8, 16, then every 16): its inputs are copied into fixed device buffers, padded
rows read and write one dummy block kept past the KV manager's pool, and their logits are
ignored::

    buffers [P]:   ids   [ t0 t1 ... t(S-1) | 0 ... 0 ]
                   slots [ s0 s1 ... s(S-1) | dummy ... ]     context_lens [ ... | 1 ... 1 ]
    tables  [P, W]: row i = request i's blocks; padded rows [dummy, ...]

On CUDA with the Triton paged-decode kernel, one CUDA graph per padded size is captured at
start-up (`capture`) and replayed; elsewhere the same path runs eagerly (with the torch
reference where no kernel serves). Prefill and mixed steps always run eagerly, through the
runner's eager backend.
"""

from __future__ import annotations

import bisect
from typing import Protocol

import torch

from engine.attention.common import DecodeRows
from engine.models.attention import AttentionMetadata, KernelDecode
from engine.models.paged_decode import PagedDecode

GRAPH_WARMUP_STEPS = 2
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


class Forward(Protocol):
    """What the padded path needs of a model (`LlamaModel`)."""

    device: torch.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: KVCaches,
                logits_rows: torch.Tensor) -> torch.Tensor: ...


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, 16, then every 16, and
    `max_num_seqs` itself where it falls between two of them."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sizes + [max_num_seqs]


class PaddedDecode:
    """Fixed buffers for decode steps up to `max_num_seqs` rows, and their CUDA graphs."""

    def __init__(self, model: Forward, kv_caches: KVCaches, kernel: PagedDecode,
                 max_num_seqs: int, block_size: int, max_blocks: int, dummy_block: int) -> None:
        self.model, self.kv_caches, self.kernel = model, kv_caches, kernel
        self.sizes = padded_sizes(max_num_seqs)
        self.block_size, self.max_blocks, self.dummy_block = block_size, max_blocks, dummy_block
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._buffers: dict[str, torch.Tensor] = {}

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def release(self) -> None:
        """Drop the buffers and the KV tensors: no step runs after this."""
        self.kv_caches = []
        self._buffers = {}

    def buffers(self) -> dict[str, torch.Tensor]:
        """Fixed input buffers for the largest padded batch (and host staging copies)."""
        if not self._buffers:
            p, dev = self.sizes[-1], self.model.device
            pin = dev.type == "cuda"
            self._buffers = {
                "stage": torch.zeros(4, p, dtype=torch.long, pin_memory=pin),
                "stage_tables": torch.zeros(p, self.max_blocks, dtype=torch.int32,
                                            pin_memory=pin),
                "inputs": torch.zeros(4, p, dtype=torch.long, device=dev),
                "context_lens": torch.ones(p, dtype=torch.int32, device=dev),
                "tables": torch.full((p, self.max_blocks), self.dummy_block,
                                     dtype=torch.int32, device=dev),
                "rows": torch.arange(p, device=dev),
            }
        return self._buffers

    def metadata(self, size: int, width: int) -> AttentionMetadata:
        """The attention metadata of the first `size` rows of the buffers."""
        b = self._buffers
        kd = KernelDecode(self.kernel, b["tables"][:size, :width], b["context_lens"][:size])
        return AttentionMetadata(slot_mapping=b["inputs"][2, :size], kernel_decode=kd)

    def forward(self, size: int, width: int) -> torch.Tensor:
        """The model on the first `size` rows of the buffers (what a graph captures)."""
        b = self._buffers
        return self.model.forward(b["inputs"][0, :size], b["inputs"][1, :size],
                                  self.metadata(size, width), self.kv_caches, b["rows"][:size])

    def fill(self, d: DecodeRows, size: int, width: int) -> None:
        """Copy a step's decode rows into the buffers; rows past them are padding."""
        b = self.buffers()
        s, w = d.input_ids.shape[0], d.tables.shape[1]
        stage, stage_tables = b["stage"], b["stage_tables"]
        stage[0, :s], stage[1, :s], stage[2, :s] = d.input_ids, d.positions, d.slots
        stage[3, :s] = d.context_lens
        stage[:2, s:size] = 0
        stage[2, s:size] = self.dummy_block * self.block_size
        stage[3, s:size] = 1
        stage_tables[:s, :w] = d.tables
        stage_tables[s:size, 0] = self.dummy_block
        b["inputs"].copy_(stage, non_blocking=True)  # contiguous: one copy (rows past size unused)
        b["context_lens"][:size].copy_(b["inputs"][3, :size])
        b["tables"][:size, :width].copy_(stage_tables[:size, :width], non_blocking=True)

    def step(self, d: DecodeRows) -> torch.Tensor:
        """Run decode rows as a padded batch (graph replay where captured); logits of
        `d.logits_rows`, then of `d.prompt_rows`."""
        s = d.input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, s)]
        graph = self.graphs.get(size)
        width = self.max_blocks if graph else d.tables.shape[1]
        self.fill(d, size, width)
        if graph is not None:
            graph[0].replay()
            logits = graph[1]
        else:
            logits = self.forward(size, width)
        if len(d.logits_rows) == s:
            return logits[:s]
        rows = d.logits_rows + d.prompt_rows
        return logits[torch.tensor(rows, device=logits.device)]

    def capture(self) -> None:
        """Capture one CUDA graph per padded size, largest first, sharing one memory pool,
        after warm-up runs (which also compile the Triton kernel). All rows are padding
        while capturing: only the dummy block is written."""
        b = self.buffers()
        b["inputs"][2].fill_(self.dummy_block * self.block_size)
        b["tables"].fill_(self.dummy_block)
        b["context_lens"].fill_(1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_STEPS):
                for size in self.sizes:  # every shape once: kernels chosen before capture
                    self.forward(size, self.max_blocks)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self.forward(size, self.max_blocks)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
