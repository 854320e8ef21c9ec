"""Turns a scheduled step into the model's inputs, runs the model, returns sampled tokens.

The runner orchestrates; the attention backends (engine/attention/) build what their
kernels need from the scheduled batch::

    execute(entries, block_tables)
      decode-only, padded path on:  PaddedDecode.step        fixed buffers, CUDA graph replay
      else:                         backend.build -> model.forward
                                      TorchGroupedBackend    no decode kernel
                                      PagedKernelBackend     the native CPU or Triton kernel
      then: prompt logprobs, sampling (greedy / sampled / draft verification), logprobs

Parallel sampling: an entry that computes the last token of a prompt whose other
candidates wait in its sequence's `siblings` is sampled once per candidate, from the one
logits row of that position (`fork_rows`): the prompt is computed once, and each
candidate's first token still comes from its own generator. Sibling k of the step (in
entry order) comes back under entry index len(entries) + k.

The backend is picked once, from the device and dtype: a paged-decode kernel where one
serves (Triton on CUDA, the native kernel on a CPU), else plain torch. The flat inputs
every backend shares (ids, positions, slot mapping, logits rows, the persistent block
tables) come from one `InputBuilder` (engine/attention/common.py).
"""

from __future__ import annotations

import math
import os

import torch

from engine import compute, speculative
from engine.attention.common import DecodeRows, Entries, InputBuilder, StepInputs
from engine.attention.cuda_graphs import PaddedDecode
from engine.attention.paged_kernel import PagedKernelBackend
from engine.attention.torch_grouped import Gather, TorchGroupedBackend
from engine.memory import pages
from engine.models import native, paged_decode
from engine.models.attention import AttentionMetadata, cache_shapes, packed_caches
from engine.models.llama import LlamaModel, ModelArch
from engine.models.native import PagedDecode
from engine.sampler import (
    greedy,
    process_logits,
    record_prompt_logprobs,
    record_sample_logprobs,
    sample,
    token_histories,
)
from engine.sequence import Sequence

Backend = TorchGroupedBackend | PagedKernelBackend


class ModelRunner:
    """Owns the KV tensors and the attention backend, and runs one step of the model."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int,
                 max_num_seqs: int | None = None) -> None:
        """`max_num_seqs` set: decode-only steps up to it may take the padded path, and on
        CUDA with the Triton kernel its CUDA graphs are captured for every padded batch size
        (unless BATCHLENS_CUDA_GRAPHS=0)."""
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks  # the KV manager's pool
        self.dummy_block = num_blocks  # one more block in the tensors, for padded rows
        dev, arch = model.device, model.arch
        self.kv_caches = compute.run(self._allocate, arch, num_blocks + 1, block_size)
        max_blocks = -(-arch.max_position_embeddings // block_size)
        # bucket the eager path's row counts where oneDNN would keep a kernel per count (not
        # where the bfloat16 kernel runs every matmul)
        self.inputs = InputBuilder(block_size, max_blocks, self.dummy_block,
                                   getattr(model, "cpu_onednn_matmuls", False))
        self.gather = Gather(arch.num_kv_heads, num_blocks + 1, dev)
        kernel = paged_decode.kernel() if dev.type == "cuda" else native.paged_decode(
            dev, model.dtype)
        self.backend: Backend = self._backend(kernel)
        self.speculative = False  # set where requests may bring drafts to verify
        self.padded_decode = False  # decode-only steps through the padded path
        self.padded: PaddedDecode | None = None
        if max_num_seqs:
            self.padded = PaddedDecode(model, self.kv_caches, kernel or paged_decode.reference,
                                       max_num_seqs, block_size, max_blocks, self.dummy_block)
        use_graphs = os.environ.get("BATCHLENS_CUDA_GRAPHS", "1") != "0"
        if dev.type == "cuda" and kernel is not None and self.padded and use_graphs:
            compute.run(self.padded.capture)
            self.padded_decode = True

    def _backend(self, kernel: PagedDecode | None) -> Backend:
        """The eager backend for `kernel`: the paged-kernel one (attending prefill rows too
        on a CPU below float32), or plain torch where no kernel serves."""
        if kernel is None:
            return TorchGroupedBackend(self.inputs, self.gather, self.model.dtype)
        paged_prefill = self.model.device.type == "cpu" and self.model.dtype != torch.float32
        return PagedKernelBackend(self.inputs, self.gather, kernel, paged_prefill)

    def _allocate(
        self, arch: ModelArch, num_blocks: int, block_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        model = self.model
        packed = native.packed_kv(model.device, model.dtype, block_size, arch.head_dim,
                                  arch.num_heads // arch.num_kv_heads)
        dims = (arch.num_kv_heads, num_blocks, block_size, arch.head_dim)
        if packed:  # K and V views of one pool per layer (see attention.py)
            return [packed_caches(pages.zeros((2 * math.prod(dims),), model.dtype), *dims)
                    for _ in range(arch.num_layers)]
        k_shape, v_shape = cache_shapes(*dims, packed)
        return [
            (
                pages.zeros(k_shape, model.dtype, model.device),
                pages.zeros(v_shape, model.dtype, model.device),
            )
            for _ in range(arch.num_layers)
        ]

    def release_kv(self) -> None:
        """Drop the KV tensors (after the loop has stopped): no step runs after this."""
        self.kv_caches = []
        if self.padded is not None:
            self.padded.release()

    # ---- the backend's knobs (tests and profiles switch paths through them) --------------
    @property
    def decode_kernel(self) -> PagedDecode | None:
        """The eager backend's decode kernel (None: the torch backend); setting it picks
        the backend again."""
        return self.backend.kernel

    @decode_kernel.setter
    def decode_kernel(self, kernel: PagedDecode | None) -> None:
        self.backend = self._backend(kernel)
        if self.padded is not None:
            self.padded.kernel = kernel or paged_decode.reference

    @property
    def paged_prefill(self) -> bool:
        """The kernel attends prefill rows too (each row a query over its own prefix)."""
        return getattr(self.backend, "paged_prefill", False)

    @paged_prefill.setter
    def paged_prefill(self, on: bool) -> None:
        self.backend.paged_prefill = on

    @property
    def bucket_rows(self) -> bool:
        """The eager path's rows are padded to `row_bucket` sizes."""
        return self.inputs.bucket_rows

    @bucket_rows.setter
    def bucket_rows(self, on: bool) -> None:
        self.inputs.bucket_rows = on

    @property
    def graphs(self) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        """The captured CUDA graphs by padded batch size."""
        return self.padded.graphs if self.padded is not None else {}

    # ---- inputs ----------------------------------------------------------------------
    def prepare(
        self, entries: Entries, block_tables: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """`prepare_inputs` as (input_ids, positions, meta, logits_rows, sampled)."""
        s = self.prepare_inputs(entries, block_tables)
        return s.input_ids, s.positions, s.meta, s.logits_rows, s.sampled

    def prepare_inputs(self, entries: Entries, block_tables: dict[str, list[int]]) -> StepInputs:
        """Input ids, positions, attention metadata and logits rows of an eager step."""
        return self.backend.build(entries, block_tables)

    def decode_rows(self, entries: Entries, decode: list[int],
                    block_tables: dict[str, list[int]]) -> DecodeRows:
        """The `decode` entries' rows (indices into `entries`), from the persistent tables."""
        return self.inputs.decode_rows(entries, decode, block_tables)

    def padded_step(self, d: DecodeRows) -> torch.Tensor:
        """Decode rows through the padded path: logits of `d.logits_rows`, `d.prompt_rows`."""
        assert self.padded is not None
        return self.padded.step(d)

    # ---- one step ------------------------------------------------------------------------
    def execute(
        self,
        entries: Entries,
        block_tables: dict[str, list[int]],
        generators: dict[str, torch.Generator | None],
    ) -> dict[int, int | list[int]]:
        """Run one step on the compute thread; map entry index -> sampled token for the
        requests whose last token was computed (for one verifying drafts: the accepted
        drafts, then one sampled token). Log-probabilities asked for are recorded on the
        sequences (`Sequence.logprobs`, `Sequence.prompt_logprobs`)."""

        def step() -> dict[int, int | list[int]]:
            if (self.padded_decode and self.padded is not None
                    and self.padded.fits(len(entries)) and all(n == 1 for _, n in entries)):
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
        self, logits: torch.Tensor, entries: Entries, sampled: list[int],
        generators: dict[str, torch.Generator | None],
    ) -> dict[int, int | list[int]]:
        """Tokens from the sampled rows' logits (row r: entry `sampled[r]`), and their
        log-probabilities where asked. A batch with no logit_bias, penalty or logprobs
        takes the plain path: the greedy argmax reads the logits as they are."""
        forks = fork_rows(entries, sampled)
        if forks:  # the waiting candidates' first tokens, from their prompt's last row
            logits = torch.cat([logits, logits[[r for r, _ in forks]]])
            sampled = [*sampled, *range(len(entries), len(entries) + len(forks))]
            entries = [*entries, *((sib, 0) for _, sib in forks)]
        seqs = [entries[i][0] for i in sampled]
        params = [s.params for s in seqs]
        raw = logits
        extra = any(p.logprobs is not None or p.processes_logits for p in params)
        if extra and any(p.processes_logits for p in params):
            logits = process_logits(logits.float(), params, token_histories(seqs),
                                    [s.matcher for s in seqs])
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


def fork_rows(entries: Entries, sampled: list[int]) -> list[tuple[int, Sequence]]:
    """(logits row, candidate) for each candidate waiting to fork from a sequence whose
    prompt this step completes (row r is entry `sampled[r]`'s last position), in entry
    order, as the core reads them back (rows need not be in entry order)."""
    rows = [(i, r) for r, i in enumerate(sampled) if entries[i][0].siblings]
    return [(r, sib) for i, r in sorted(rows) for sib in entries[i][0].siblings]
