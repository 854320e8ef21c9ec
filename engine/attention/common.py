"""What every attention backend starts from: the step's flat inputs and the persistent block
tables (vLLM's common attention metadata).

Flat batch layout for one step (T tokens)::

    rows:  [ d0 d1 d2 ... d(S-1) | p0 p0 p0 p0 | p1 p1 ... | pad pad ]
             decode: 1 token each   prefill chunk of request p0, then p1 ...  row bucket

    input_ids[T], positions[T], slot_mapping[T]  (slot = block_table[pos // bs] * bs + pos % bs)

Any entry with exactly one new token is a decode row (its context is read from the cache),
whatever phase its request is in; a backend picks the decode rows' order.

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
once with numpy, not block by block in Python.

Row buckets. Where oneDNN keeps a kernel per matmul row count, the flat batch (and its
logits rows) is padded up to `row_bucket(T)` by one padding chunk: a request of its own,
positions 0.., writing into the dummy block past the KV manager's pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.attention import AttentionMetadata, PrefillChunk
from engine.sequence import Sequence

Entries = list[tuple[Sequence, int]]  # (request, tokens scheduled this step)


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
    """The decode entries of one step as tensors on the host, in the backend's order."""

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
    """One eager step's flat inputs on the device (see the module's notes for the rows)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor
    sampled: list[int]  # entry index of each sampled row
    prompt: list[tuple[int, int]]  # (entry index, position) of each prompt-logprobs row


@dataclass
class FlatBatch:
    """A step's flat inputs on the host, before a backend adds what its kernel needs.

    `prefills` carry no gather index yet; with bucketed rows the last one is the padding
    chunk, which has no entry in `chunk_tables`.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    decode: DecodeRows | None
    prefills: list[PrefillChunk]
    chunk_tables: list[list[int]]  # each real prefill chunk's block table
    logits_rows: list[int]
    sampled: list[int]
    prompt: list[tuple[int, int]]

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def to_device(self, meta: AttentionMetadata, device: torch.device) -> StepInputs:
        """The step's inputs on `device`, with `meta` (whose slot mapping is set here)."""
        meta.slot_mapping = self.slot_mapping.to(device)
        return StepInputs(self.input_ids.to(device), self.positions.to(device), meta,
                          torch.tensor(self.logits_rows, dtype=torch.long).to(device),
                          self.sampled, self.prompt)


def prompt_positions(seq: Sequence, start: int, end: int) -> range:
    """Positions in [start, end) whose logits give a prompt token's log-probability that
    is not recorded yet (position p predicts prompt token p + 1)."""
    if not seq.wants_prompt_logits:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs) - 1),
                 min(end, len(seq.prompt_token_ids) - 1))


def decode_entries(entries: Entries) -> list[int]:
    """Indices of the entries with exactly one new token (the decode rows)."""
    return [i for i, (_, n) in enumerate(entries) if n == 1]


class InputBuilder:
    """Builds the flat inputs every backend shares, from the persistent block tables.

    `bucket_rows` pads the flat batch to `row_bucket` sizes (where oneDNN would keep a
    kernel per row count); the padding rows write to `dummy_block`.
    """

    def __init__(self, block_size: int, max_blocks: int, dummy_block: int,
                 bucket_rows: bool = False) -> None:
        self.block_size = block_size
        self.dummy_block = dummy_block
        self.bucket_rows = bucket_rows
        self.tables = BlockTables(max_blocks)

    def decode_rows(self, entries: Entries, decode: list[int],
                    block_tables: dict[str, list[int]]) -> DecodeRows:
        """Tokens, positions, slots, table rows and context lengths of the `decode` entries
        (indices into `entries`, in that order), from the persistent block tables."""
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

    def flat_batch(self, entries: Entries, decode: list[int],
                   block_tables: dict[str, list[int]]) -> FlatBatch:
        """The step's flat inputs: the `decode` entries first (in that order), then each
        prefill chunk in entry order, then the bucket's padding chunk."""
        bs = self.block_size
        parts_ids, parts_pos, parts_slots = [], [], []
        logits_rows: list[int] = []
        sampled: list[int] = []
        prompt_rows: list[int] = []
        prompt: list[tuple[int, int]] = []
        d = self.decode_rows(entries, decode, block_tables) if decode else None
        if d is not None:
            parts_ids.append(d.input_ids)
            parts_pos.append(d.positions)
            parts_slots.append(d.slots)
            logits_rows += d.logits_rows
            sampled += d.sampled
            prompt_rows += d.prompt_rows
            prompt += d.prompt
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        chunk_tables: list[list[int]] = []
        row = len(decode)
        for i, (seq, n) in enumerate(entries):
            if n <= 1:
                continue
            start = seq.num_computed_tokens
            table = block_tables[seq.request_id]
            ids.extend(seq.token_ids[start : start + n])
            drafts = seq.spec_token_ids
            if drafts:  # speculative decoding: the last token, then the drafts to verify
                ids.extend(drafts)
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx = start + n
            prefills.append(PrefillChunk(row, n, ctx, None))
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
            prefills.append(PrefillChunk(row, pad, pad, None))
            row += pad
        if ids:
            parts_ids.append(torch.tensor(ids))
            parts_pos.append(torch.tensor(pos))
            parts_slots.append(torch.tensor(slots))
        logits_rows += prompt_rows
        if self.bucket_rows and logits_rows:
            # the LM head's rows too: repeat the last one (the caller keeps the rows it reads)
            logits_rows += logits_rows[-1:] * (row_bucket(len(logits_rows)) - len(logits_rows))
        return FlatBatch(_cat(parts_ids), _cat(parts_pos), _cat(parts_slots), d, prefills,
                         chunk_tables, logits_rows, sampled, prompt)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=torch.long)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
