"""Attention backends, vLLM's way: each turns the scheduled batch into what its kernel needs.

    common.py         the flat inputs every backend shares, the persistent block tables
    torch_grouped.py  plain torch: decode rows in padded groups, SDPA per prefill chunk
    paged_kernel.py   a paged-decode kernel (native CPU, Triton) reading K/V in place
    cuda_graphs.py    decode-only steps in fixed buffers, CUDA graph capture and replay
"""
