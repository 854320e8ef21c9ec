"""Turns a scheduled step into flat tensors, runs the model, returns sampled tokens.

Flat batch layout for one step (T tokens)::

    rows:  [ d0 d1 d2 ... d(S-1) | p0 p0 p0 p0 | p1 p1 ... ]
             decode: 1 token each   prefill chunk of request p0, then p1 ...

    input_ids[T], positions[T], slot_mapping[T]  (slot = block_table[pos // bs] * bs + pos % bs)

Any entry with exactly one new token is attended as a decode row (its context is read
from the cache), whatever phase its request is in.

Logits rows. The LM head runs only on the rows whose logits are read: first every sampled
row (`sampled`: their entry indices), then, for requests asking for prompt
log-probabilities, every prompt position not recorded yet (`prompt`: (entry, position))::

    logits_rows  [ sampled rows ... | prompt-logprob rows ... | bucket padding ]

Position p's logits predict token p + 1, so a prompt's first token has no log-probability
(`Sequence.prompt_logprobs[0]` is None) and its last position is the sampled row::

    prompt   t0    t1      t2      t3    | o0 ...
    logits   l0    l1      l2      l3
    records  None  l0(t1)  l1(t2)  l2(t3)   l3 samples o0 (its logprob, if asked)

Persistent inputs. Each running request keeps one row of `BlockTables` (a host array of
block ids) from step to step; a step copies in only the blocks a request gained since its
last one. The decode rows' slots and context lengths are then computed for all rows at
once with tensor ops, not block by block in Python.

Padded decode (the path CUDA graphs replay). A decode-only step of S requests runs as a
batch padded up to the next of `padded_sizes` (1, 2, 4, 8, 16, then every 16): its inputs
are copied into fixed device buffers, padded rows read and write one dummy block kept
past the KV manager's pool, and their logits are ignored::

    buffers [P]:   ids   [ t0 t1 ... t(S-1) | 0 ... 0 ]
                   slots [ s0 s1 ... s(S-1) | dummy ... ]     context_lens [ ... | 1 ... 1 ]
    tables  [P, W]: row i = request i's blocks; padded rows [dummy, ...]

On CUDA with the Triton paged-decode kernel, one CUDA graph per padded size is captured at
start-up and replayed; on CPU the same path runs eagerly when `padded_decode` is set.
Prefill and mixed steps always run eagerly.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import compute, speculative
from engine.models import native, paged_decode
from engine.models.attention import (
    AttentionMetadata,
    DecodeGroup,
    KernelDecode,
    PrefillChunk,
    gather_index,
)
from engine.models.llama import LlamaModel, ModelSpec
from engine.sampler import (
    greedy,
    process_logits,
    record_prompt_logprobs,
    record_sample_logprobs,
    sample,
    token_histories,
)
from engine.sequence import Sequence

GROUP_OVERHEAD = 24  # cost of one more decode group, in padded (request x block) units
# A decode group with at most this many padded keys in all (requests x keys) runs through
# the fused SDPA kernel; larger ones through two batched matmuls, which scale better on CPU
# (on a small CPU SDPA is 3-4x faster at 1 request and 2x slower at 16).
SDPA_MAX_KEYS = 1024
GRAPH_WARMUP_STEPS = 2


def split_by_length(num_blocks: list[int], depth: int = 2) -> list[tuple[int, int]]:
    """Split ascending per-request block counts into runs [start, end) padded separately.

    A group pads every member to its longest one; splitting saves padded work but costs
    more calls per layer. Take the best single split if it saves more than that overhead,
    then try again inside each half (up to 2**depth groups).
    """
    return _split(num_blocks, 0, len(num_blocks), depth)


def _split(nb: list[int], start: int, end: int, depth: int) -> list[tuple[int, int]]:
    if end <= start:
        return []
    whole = (end - start) * nb[end - 1]
    best, cut = whole, None
    if depth > 0:
        for i in range(start + 1, end):
            cost = (i - start) * nb[i - 1] + (end - i) * nb[end - 1] + GROUP_OVERHEAD
            if cost < best:
                best, cut = cost, i
    if cut is None:
        return [(start, end)]
    return _split(nb, start, cut, depth - 1) + _split(nb, cut, end, depth - 1)


def padded_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes a decode step is padded to: 1, 2, 4, 8, 16, then every 16, and
    `max_num_seqs` itself where it falls between two of them."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sizes + [max_num_seqs]


def row_bucket(rows: int) -> int:
    """Row count a CPU step's flat batch is padded up to: exact up to 32, then every 4 up
    to 128, every 16 up to 512, every 64 up to 2,048, then every 256 (at most ~3% padded
    rows on average past 32).

    oneDNN keeps memory for every new matmul row count it meets on a bfloat16 CPU (about
    0.3-0.7 MiB each, not returned when its primitive cache evicts them): 600 distinct counts
    grow a process by ~800 MiB, while the same counts rounded to 38 sizes grow it by
    ~100 MiB and then not at all. A server meeting every
    prompt length would grow for hours; bucketed, the set of shapes is bounded.
    """
    if rows <= 32:
        return rows
    step = 4 if rows <= 128 else 16 if rows <= 512 else 64 if rows <= 2048 else 256
    return -(-rows // step) * step


class BlockTables:
    """The block tables of running requests as rows of one host array, kept between steps.

    A row mirrors one request's block table (the KV manager's list object); a step copies
    in only the blocks appended since the last step. A row whose request is gone (finished,
    preempted: its list was dropped) is reclaimed when rows run out.
    """

    def __init__(self, width: int, rows: int = 64) -> None:
        self.array = np.zeros((rows, max(width, 1)), dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self.table_of: list[list[int] | None] = [None] * rows
        self.copied = [0] * rows  # blocks of the request's table copied into its row
        self.free = list(range(rows - 1, -1, -1))

    def sync(self, request_id: str, table: list[int], live: dict[str, list[int]]) -> int:
        """The request's row, with every block of `table` copied in."""
        r = self.row_of.get(request_id)
        if r is None:
            if not self.free:
                self._reclaim(live)
            r = self.free.pop()
            self.row_of[request_id] = r
        if self.table_of[r] is not table:  # a new request, or one freed and back
            self.table_of[r], self.copied[r] = table, 0
        n, done = len(table), self.copied[r]
        if n > self.array.shape[1]:
            self._resize(self.array.shape[0], max(n, 2 * self.array.shape[1]))
        self.array[r, done:n] = table[done:n]
        self.copied[r] = n
        return r

    def _reclaim(self, live: dict[str, list[int]]) -> None:
        for rid, r in list(self.row_of.items()):
            if live.get(rid) is not self.table_of[r]:
                del self.row_of[rid]
                self.table_of[r], self.copied[r] = None, 0
                self.free.append(r)
        if not self.free:
            rows = self.array.shape[0]
            self._resize(2 * rows, self.array.shape[1])
            self.table_of += [None] * rows
            self.copied += [0] * rows
            self.free = list(range(2 * rows - 1, rows - 1, -1))

    def _resize(self, rows: int, width: int) -> None:
        grown = np.zeros((rows, width), dtype=np.int32)
        old_rows, old_width = self.array.shape
        grown[:old_rows, :old_width] = self.array
        self.array = grown


@dataclass
class DecodeRows:
    """The decode entries of one step as tensors on the host, in entry order."""

    input_ids: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64
    slots: torch.Tensor  # [S] int64
    tables: torch.Tensor  # [S, W] int32, W = the longest context's block count
    context_lens: torch.Tensor  # [S] int32
    logits_rows: list[int]  # rows (0..S-1) to sample
    sampled: list[int]  # their entry indices
    prompt_rows: list[int] = field(default_factory=list)  # rows giving prompt logprobs
    prompt: list[tuple[int, int]] = field(default_factory=list)  # their (entry, position)


@dataclass
class StepInputs:
    """One eager step's flat inputs (see the module's notes for the logits rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampled: list[int]  # entry index of each sampled row
    prompt: list[tuple[int, int]]  # (entry index, position) of each prompt-logprobs row


def prompt_positions(seq: Sequence, start: int, end: int) -> range:
    """Positions in [start, end) whose logits give a prompt token's log-probability that
    is not recorded yet (position p predicts prompt token p + 1)."""
    if not seq.wants_prompt_logits:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs) - 1),
                 min(end, len(seq.prompt_token_ids) - 1))


class ModelRunner:
    """Owns the KV tensors and the step's input buffers, and runs one step of the model."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 max_num_seqs: int | None = None) -> None:
        """`max_num_seqs` set: on CUDA with the Triton kernel, capture decode CUDA graphs
        for every padded batch size up to it (unless BATCHLENS_CUDA_GRAPHS=0)."""
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks  # the KV manager's pool
        self.dummy_block = num_blocks  # one more block in the tensors, for padded rows
        spec = model.spec
        self.num_kv_heads = spec.num_kv_heads
        dev = model.device
        if dev.type == "cuda":
            self.decode_kernel = paged_decode.kernel()
        else:
            self.decode_kernel = native.paged_decode(dev, model.dtype)
        self.kv_caches = compute.run(self._allocate, spec, num_blocks + 1, block_size)
        self.max_blocks = -(-spec.max_position_embeddings // block_size)
        self.tables = BlockTables(self.max_blocks)
        self.max_num_seqs = max_num_seqs
        self.sizes: list[int] = padded_sizes(max_num_seqs) if max_num_seqs else []
        self.padded_decode = False  # decode-only steps through the padded path
        # bucket the eager path's row counts where oneDNN would keep a kernel per count (not
        # where the bfloat16 kernel runs every matmul)
        self.bucket_rows = getattr(model, "cpu_onednn_matmuls", False)
        # the CPU kernel attends prefill rows too (each row a query over its own prefix)
        self.paged_prefill = (dev.type == "cpu" and self.decode_kernel is not None
                              and model.dtype != torch.float32)
        self.speculative = False  # set where requests may bring drafts to verify
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        use_graphs = os.environ.get("BATCHLENS_CUDA_GRAPHS", "1") != "0"
        if dev.type == "cuda" and self.decode_kernel is not None and self.sizes and use_graphs:
            compute.run(self.capture_graphs)

    def release_kv(self) -> None:
        """Drop the KV tensors (after the loop has stopped): no step runs after this."""
        self.kv_caches = []
        self._buffers = {}

    def _allocate(
        self, spec: ModelSpec, num_blocks: int, block_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        model = self.model
        shape = (spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
        return [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(spec.num_layers)
        ]

    def _gather_index(self, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        return gather_index(ids, self.num_kv_heads, self.num_blocks + 1).to(self.model.device)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    # ---- inputs ----------------------------------------------------------------------
    def decode_rows(
        self, entries: list[tuple[Sequence, int]], decode: list[int],
        block_tables: dict[str, list[int]],
    ) -> DecodeRows:
        """Tokens, positions, slots, table rows and context lengths of the `decode` entries
        (indices into `entries`), from the persistent block tables."""
        bs, bt = self.block_size, self.tables
        row_of, table_of, copied = bt.row_of, bt.table_of, bt.copied
        rows, pos, ids, logits_rows, sampled = [], [], [], [], []
        prompt_rows: list[int] = []
        prompt: list[tuple[int, int]] = []
        for j, i in enumerate(decode):
            seq = entries[i][0]
            rid = seq.request_id
            table = block_tables[rid]
            r = row_of.get(rid)
            if r is None or table_of[r] is not table or copied[r] != len(table):
                r = bt.sync(rid, table, block_tables)
            rows.append(r)
            p = seq.num_computed_tokens
            pos.append(p)
            ids.append(seq.token_at(p))
            if p + 1 == seq.num_tokens:
                logits_rows.append(j)
                sampled.append(i)
            elif prompt_positions(seq, p, p + 1):  # a one-token chunk of a prompt
                prompt_rows.append(j)
                prompt.append((i, p))
        # vectorised on the host in numpy (a small op costs ~1 us there, ~5 in torch)
        p_np = np.array(pos, dtype=np.int64)
        block = p_np // bs
        tables = bt.array[np.array(rows), : int(block.max()) + 1]
        slots = tables[np.arange(len(rows)), block].astype(np.int64) * bs + p_np % bs
        return DecodeRows(torch.tensor(ids), torch.from_numpy(p_np), torch.from_numpy(slots),
                          torch.from_numpy(tables), torch.from_numpy((p_np + 1).astype(np.int32)),
                          logits_rows, sampled, prompt_rows, prompt)

    def prepare(
        self, entries: list[tuple[Sequence, int]], block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """`prepare_inputs` as (input_ids, positions, meta, logits_rows, sampled)."""
        s = self.prepare_inputs(entries, block_tables)
        return s.input_ids, s.positions, s.meta, s.logits_rows, s.sampled

    def prepare_inputs(
        self, entries: list[tuple[Sequence, int]], block_tables: dict[str, list[int]]
    ) -> StepInputs:
        """Build input ids, positions, attention metadata and the logits rows (eager path)."""
        bs, dev = self.block_size, self.model.device
        decode = [i for i, (_, n) in enumerate(entries) if n == 1]
        prefill = [i for i, (_, n) in enumerate(entries) if n > 1]
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
        parts_ids, parts_pos, parts_slots = [], [], []
        logits_rows: list[int] = []
        sampled: list[int] = []
        prompt_rows: list[int] = []
        prompt: list[tuple[int, int]] = []
        d: DecodeRows | None = None
        chunk_tables: list[list[int]] = []  # each prefill chunk's block table
        kernel_rows = self.paged_prefill and self.decode_kernel is not None
        if decode:
            if self.decode_kernel is None:
                # sorted by context length, so similar lengths share a padded group
                decode.sort(key=lambda i: entries[i][0].num_computed_tokens)
            d = self.decode_rows(entries, decode, block_tables)
            parts_ids.append(d.input_ids)
            parts_pos.append(d.positions)
            parts_slots.append(d.slots)
            logits_rows += d.logits_rows
            sampled += d.sampled
            prompt_rows += d.prompt_rows
            prompt += d.prompt
            if self.decode_kernel is not None:
                meta.kernel_decode = KernelDecode(self.decode_kernel, d.tables.to(dev),
                                                  d.context_lens.to(dev))
            else:
                self._decode_groups(meta, d)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        row = len(decode)
        for i in prefill:
            seq, n = entries[i]
            start = seq.num_computed_tokens
            table = block_tables[seq.request_id]
            ids.extend(seq.token_ids[start : start + n])
            drafts = seq.spec_token_ids
            if drafts:  # speculative decoding: the last token, then the drafts to verify
                ids.extend(drafts)
            pos.extend(range(start, start + n))
            slots.extend(self._slots(table, start, start + n))
            ctx = start + n
            index = None
            if start > 0 and not kernel_rows:
                index = self._gather_index(table[: -(-ctx // bs)])
            meta.prefills.append(PrefillChunk(row, n, ctx, index))
            chunk_tables.append(table)
            if ctx == seq.num_tokens + len(drafts):  # sampled: every verified position
                logits_rows.extend(range(row + n - 1 - len(drafts), row + n))
                sampled.extend([i] * (len(drafts) + 1))
            for p in prompt_positions(seq, start, start + n):
                prompt_rows.append(row + p - start)
                prompt.append((i, p))
            row += n
        if self.bucket_rows and (pad := row_bucket(row) - row):
            # padding rows: a request of their own attending only to itself, positions
            # 0.., writing into the dummy block past the pool; nothing reads them back
            ids.extend([0] * pad)
            pos.extend(range(pad))
            slots.extend(self.dummy_block * bs + i % bs for i in range(pad))
            meta.prefills.append(PrefillChunk(row, pad, pad, None))
            row += pad
        if kernel_rows and meta.prefills:
            self._kernel_rows(meta, d, chunk_tables)
        if ids:
            parts_ids.append(torch.tensor(ids))
            parts_pos.append(torch.tensor(pos))
            parts_slots.append(torch.tensor(slots))
        logits_rows += prompt_rows
        if self.bucket_rows and logits_rows:
            # the LM head's rows too: repeat the last one (the caller keeps the rows it reads)
            logits_rows += logits_rows[-1:] * (row_bucket(len(logits_rows)) - len(logits_rows))
        meta.slot_mapping = _cat(parts_slots).to(dev)
        return StepInputs(_cat(parts_ids).to(dev), _cat(parts_pos).to(dev), meta,
                          torch.tensor(logits_rows, dtype=torch.long).to(dev), sampled, prompt)

    def _kernel_rows(self, meta: AttentionMetadata, d: DecodeRows | None,
                     chunk_tables: list[list[int]]) -> None:
        """Every row of the step to the CPU kernel, which reads K/V in place: the decode rows
        as they are, each prefill row with its request's block table and its own position + 1
        keys (causal: the chunk's K/V are already in the cache), a padding chunk past
        `chunk_tables` one key of the dummy block. No gathered copy, no SDPA call per chunk."""
        bs, chunks = self.block_size, meta.prefills
        num_rows = chunks[-1].start + chunks[-1].length
        widths = [-(-c.context_len // bs) for c in chunks[: len(chunk_tables)]]
        width = max(widths + ([d.tables.shape[1]] if d is not None else []) + [1])
        tables = np.zeros((num_rows, width), dtype=np.int32)
        lens = np.ones(num_rows, dtype=np.int32)
        if d is not None:
            s, w = d.tables.shape
            tables[:s, :w], lens[:s] = d.tables.numpy(), d.context_lens.numpy()
        for k, c in enumerate(chunks):
            rows = slice(c.start, c.start + c.length)
            if k < len(chunk_tables):
                tables[rows, : widths[k]] = chunk_tables[k][: widths[k]]
                lens[rows] = np.arange(c.prior_len + 1, c.context_len + 1, dtype=np.int32)
            else:
                tables[rows, 0] = self.dummy_block
        meta.kernel_decode = KernelDecode(self.decode_kernel, torch.from_numpy(tables),
                                          torch.from_numpy(lens))
        meta.prefills = []

    def _decode_groups(self, meta: AttentionMetadata, d: DecodeRows) -> None:
        """The torch path: decode rows (sorted by length) in groups padded separately."""
        bs, dev, dtype = self.block_size, self.model.device, self.model.dtype
        lens = d.context_lens.tolist()
        for start, end in split_by_length([-(-n // bs) for n in lens]):
            max_blocks = -(-lens[end - 1] // bs)
            s = end - start
            index = self._gather_index(d.tables[start:end, :max_blocks].reshape(-1))
            keys = torch.arange(max_blocks * bs)
            pad = keys[None, :] >= d.context_lens[start:end, None]
            bias = torch.zeros(pad.shape).masked_fill_(pad, float("-inf"))
            meta.decode_groups.append(DecodeGroup(
                start, s, index, bias.view(1, s, 1, -1).to(device=dev, dtype=dtype),
                pad.numel() <= SDPA_MAX_KEYS))

    # ---- the padded decode path (CUDA graphs) --------------------------------------------
    def _padded_kernel(self) -> paged_decode.PagedDecode:
        return self.decode_kernel or paged_decode.reference

    def _padded_buffers(self) -> dict[str, torch.Tensor]:
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

    def _padded_forward(self, size: int, width: int) -> torch.Tensor:
        """The model on the first `size` rows of the buffers (what a graph captures)."""
        b = self._buffers
        kd = KernelDecode(self._padded_kernel(), b["tables"][:size, :width],
                          b["context_lens"][:size])
        meta = AttentionMetadata(slot_mapping=b["inputs"][2, :size], kernel_decode=kd)
        return self.model.forward(b["inputs"][0, :size], b["inputs"][1, :size], meta,
                                  self.kv_caches, b["rows"][:size])

    def _fill_padded(self, d: DecodeRows, size: int, width: int) -> None:
        """Copy a step's decode rows into the buffers; rows past them are padding."""
        b = self._padded_buffers()
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

    def padded_step(self, d: DecodeRows) -> torch.Tensor:
        """Run decode rows as a padded batch (graph replay where captured); logits of
        `d.logits_rows`, then of `d.prompt_rows`."""
        s = d.input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, s)]
        graph = self.graphs.get(size)
        width = self.max_blocks if graph else d.tables.shape[1]
        self._fill_padded(d, size, width)
        if graph is not None:
            graph[0].replay()
            logits = graph[1]
        else:
            logits = self._padded_forward(size, width)
        if len(d.logits_rows) == s:
            return logits[:s]
        rows = d.logits_rows + d.prompt_rows
        return logits[torch.tensor(rows, device=logits.device)]

    def capture_graphs(self) -> None:
        """Capture one CUDA graph per padded size, largest first, sharing one memory pool,
        after warm-up runs (which also compile the Triton kernel). All rows are padding
        while capturing: only the dummy block is written."""
        b = self._padded_buffers()
        b["inputs"][2].fill_(self.dummy_block * self.block_size)
        b["tables"].fill_(self.dummy_block)
        b["context_lens"].fill_(1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_STEPS):
                for size in self.sizes:  # every shape once: kernels chosen before capture
                    self._padded_forward(size, self.max_blocks)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._padded_forward(size, self.max_blocks)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.padded_decode = True

    # ---- one step ------------------------------------------------------------------------
    def execute(
        self,
        entries: list[tuple[Sequence, int]],
        block_tables: dict[str, list[int]],
        generators: dict[str, torch.Generator | None],
    ) -> dict[int, int | list[int]]:
        """Run one step on the compute thread; map entry index -> sampled token for the
        requests whose last token was computed (for one verifying drafts: the accepted
        drafts, then one sampled token). Log-probabilities asked for are recorded on the
        sequences (`Sequence.logprobs`, `Sequence.prompt_logprobs`)."""

        def step() -> dict[int, int | list[int]]:
            if (self.padded_decode and self.sizes and len(entries) <= self.sizes[-1]
                    and all(n == 1 for _, n in entries)):
                d = self.decode_rows(entries, list(range(len(entries))), block_tables)
                logits, sampled, prompt = self.padded_step(d), d.sampled, d.prompt
            else:
                s = self.prepare_inputs(entries, block_tables)
                logits = self.model.forward(s.input_ids, s.positions, s.meta, self.kv_caches,
                                            s.logits_rows)
                sampled, prompt = s.sampled, s.prompt
            n = len(sampled)  # logits rows: sampled, then prompt positions, then padding
            if prompt:
                record_prompt_logprobs(logits[n : n + len(prompt)],
                                       [(entries[i][0], p) for i, p in prompt])
            return self.sample_rows(logits[:n], entries, sampled, generators)

        return compute.run(step)

    def sample_rows(
        self, logits: torch.Tensor, entries: list[tuple[Sequence, int]], sampled: list[int],
        generators: dict[str, torch.Generator | None],
    ) -> dict[int, int | list[int]]:
        """Tokens from the sampled rows' logits (row r: entry `sampled[r]`), and their
        log-probabilities where asked. A batch with no logit_bias, penalty or logprobs
        takes the plain path: the greedy argmax reads the logits as they are."""
        seqs = [entries[i][0] for i in sampled]
        params = [s.params for s in seqs]
        raw = logits
        extra = any(p.logprobs is not None or p.processes_logits for p in params)
        if extra and any(p.processes_logits for p in params):
            logits = process_logits(logits.float(), params, token_histories(seqs))
        if self.speculative and any(s.spec_token_ids for s in seqs):
            out = speculative.verify_batch(logits.float(), entries, sampled, generators)
        else:
            if any(not p.greedy for p in params):
                gens = [generators.get(s.request_id) for s in seqs]
                tokens = sample(logits.float(), params, gens)
            else:  # every request greedy: one argmax over the logits as they are
                tokens = greedy(logits)
            out = dict(zip(sampled, tokens, strict=True))
        if extra:
            record_sample_logprobs(raw, seqs, sampled, out)
        return out


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=torch.long)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
