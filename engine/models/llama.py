"""Our Llama-family forward (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

One call runs one flat batch of tokens from many requests (prefill chunks and decode
tokens together). Per layer: RMSNorm -> fused QKV matmul -> RoPE -> K/V written by slot
mapping -> paged attention -> output matmul -> RMSNorm -> fused gate/up matmul -> SiLU ->
down matmul. Logits are computed only for the rows that will be sampled. On a CPU in
bfloat16 the elementwise steps between the matmuls run as three fused native ops per
layer (`_forward_fused`, csrc/layer_ops.cpp); float32 keeps torch's ops, which give
transformers' results bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.memory import pages
from engine.models import loader, native
from engine.models.attention import AttentionMetadata, paged_attention, write_kv
from engine.models.linear import Linear, should_pack, should_pack_lm_head


@dataclass(frozen=True)
class ModelArch:
    """Architecture facts read from config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArch:
        heads = cfg["num_attention_heads"]
        model_type = cfg["model_type"]
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv heads x head dim x bytes per element."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem



def rope_inv_freq(cfg: dict, arch: ModelArch) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and attention scaling, as transformers computes them."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rope_type == "default":
        dim = arch.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise loader.ModelLoadError(f"rope type {rope_type!r} is not supported")
    hf_cfg = AutoConfig.for_model(**cfg)
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, torch.device("cpu"))
    return inv.float(), float(scaling)


@dataclass
class Layer:
    """One decoder layer's weights, with Q/K/V and gate/up fused."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    """Weights plus the forward pass; holds no KV cache (the runner owns it)."""

    def __init__(
        self, arch: ModelArch, state: dict[str, torch.Tensor], inv_freq: torch.Tensor,
        rope_scaling: float, device: torch.device, dtype: torch.dtype,
    ) -> None:
        self.arch, self.device, self.dtype = arch, device, dtype

        def w(name: str) -> torch.Tensor:
            if name not in state:
                raise loader.ModelLoadError(f"weight {name!r} missing from the checkpoint")
            return state[name].to(device=device, dtype=dtype).contiguous()

        pack, kernel = should_pack(device, dtype), native.bf16_linear(device, dtype)
        # CPU bfloat16: residual add + RMSNorm, RoPE + K/V write, SiLU x up fused (csrc/)
        self.fused_ops = native.layer_ops(device, dtype)
        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        head = should_pack_lm_head(device, dtype)
        if arch.tie_word_embeddings or "lm_head.weight" not in state:
            self.lm_head = Linear(self.embed, pack=head, kernel=kernel)
        else:
            self.lm_head = Linear(w("lm_head.weight"), pack=head, kernel=kernel)
        self.layers: list[Layer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            att, mlp = p + "self_attn.", p + "mlp."
            bias = None
            if f"{att}q_proj.bias" in state:
                bias = torch.cat([w(f"{att}{x}_proj.bias") for x in "qkv"])
            self.layers.append(Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=Linear(torch.cat([w(f"{att}{x}_proj.weight") for x in "qkv"]), bias, pack,
                           kernel),
                o=Linear(w(att + "o_proj.weight"), pack=pack, kernel=kernel),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=Linear(torch.cat([w(mlp + "gate_proj.weight"),
                                          w(mlp + "up_proj.weight")]), pack=pack,
                                 kernel=kernel),
                down=Linear(w(mlp + "down_proj.weight"), pack=pack, kernel=kernel),
            ))
        # a CPU matmul in oneDNN (packed, or float16 / bfloat16 by F.linear) keeps memory per
        # row count: the step's rows are then padded to a few sizes
        # (`engine.attention.common.row_bucket`)
        linears = [self.lm_head] + [lin for layer in self.layers
                                    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        # the weights a step streams, on 2 MiB pages in one buffer (engine.memory.pages)
        streamed = [lin for lin in linears if not lin.packed]
        for lin, moved in zip(streamed, pages.gathered([lin.weight for lin in streamed]),
                              strict=True):
            if lin.weight is self.embed:  # tied, unpacked: the lookups read the copy too
                self.embed = moved
            lin.weight = moved
        self.cpu_onednn_matmuls = device.type == "cpu" and any(
            lin.packed or (dtype != torch.float32 and not lin.kernel) for lin in linears)
        # every layer in one native call (csrc/decoder.cpp) where each of its matmuls is the
        # bfloat16 kernel and the native attention kernel attends every row of the step
        self.attention_kernel = native.paged_decode(device, dtype)
        self.layer_stack: list[torch.Tensor] | None = None
        # the LM head the stack's call runs too, where it is the kernel (else an empty
        # tensor: the call returns the normed rows for `lm_head`)
        empty = torch.empty(0, dtype=dtype, device=device)
        lm = self.lm_head
        self.stack_head = lm.weight if lm.kernel and lm.bias is None else empty
        if self.fused_ops and self.attention_kernel is not None and all(
                lin.kernel for lin in linears[1:]):
            self.layer_stack = [
                t for layer in self.layers
                for t in (layer.input_norm, layer.qkv.weight,
                          layer.qkv.bias if layer.qkv.bias is not None else empty,
                          layer.o.weight, layer.post_norm, layer.gate_up.weight,
                          layer.down.weight)]
        # cos/sin for every position, in float32 as transformers computes them
        pos = torch.arange(arch.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * rope_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * rope_scaling).to(device=device, dtype=dtype)
        self.scale = 1.0 / math.sqrt(arch.head_dim)

    @classmethod
    def from_folder(cls, folder: Path, device: torch.device, dtype: torch.dtype) -> LlamaModel:
        cfg = loader.read_config(folder)
        arch = ModelArch.from_config(cfg)
        inv, scaling = rope_inv_freq(cfg, arch)
        return cls(arch, loader.read_state_dict(folder), inv, scaling, device, dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.arch.rms_norm_eps
        if x.dtype == torch.float32:
            # as transformers: normalise, then scale (bit-identical in float32)
            return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
        # one fused kernel: normalises in float32, scales, rounds once
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Run one flat batch; return the logits of `logits_rows` only, [R, vocab], in the
        model's dtype (greedy sampling reads bfloat16 in place; the sampler takes float32)."""
        if self.fused_ops:
            return self._forward_fused(input_ids, positions, meta, kv_caches, logits_rows)
        arch = self.arch
        t = input_ids.shape[0]
        h, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = h * d, kvh * d
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x = self.embed[input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hs = self._rms_norm(x, layer.input_norm)
            qkv = layer.qkv(hs)
            # RoPE on q and k heads together: [T, H + kvh, d]
            qk = self._rope(qkv[:, : q_size + kv_size].view(t, h + kvh, d), cos, sin)
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, q_size + kv_size :].view(t, kvh, d)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            x = x + layer.o(attn)
            hs = self._rms_norm(x, layer.post_norm)
            gate, up = layer.gate_up(hs).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        x = self._rms_norm(x[logits_rows], self.norm)
        return self.lm_head(x)

    def _forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` with the layer's elementwise work in three fused calls (csrc/layer_ops):
        the residual stream `x` is updated in place by each `add_rms_norm`. Where the kernels
        serve every layer and row of the step, one call runs the same ops (csrc/decoder.cpp)."""
        arch, ops = self.arch, torch.ops.batchlens
        t, eps = input_ids.shape[0], arch.rms_norm_eps
        h, kvh, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_end, k_end = h * d, (h + kvh) * d
        x = self.embed[input_ids]
        kd = meta.kernel_decode
        if (self.layer_stack is not None and kd is not None and kd.num_seqs == t
                and kd.kernel is self.attention_kernel):
            # the final norm and the LM head in the same call, where the head is the kernel
            out = ops.forward_layers(
                x, self.layer_stack, [k for k, _ in kv_caches], [v for _, v in kv_caches],
                self.cos, self.sin, positions, meta.slot_mapping, kd.block_tables,
                kd.context_lens, logits_rows, self.norm, self.stack_head, h, kvh, eps,
                self.scale)
            return out if self.stack_head.numel() else self.lm_head(out)
        delta = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            hs = ops.add_rms_norm(x, delta, layer.input_norm, eps)
            qkv = layer.qkv(hs)
            ops.rope_write_kv(qkv, self.cos, self.sin, positions, k_cache, v_cache,
                              meta.slot_mapping, h, kvh)
            q = qkv[:, :q_end].view(t, h, d)
            k = qkv[:, q_end:k_end].view(t, kvh, d)
            v = qkv[:, k_end:].view(t, kvh, d)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            hs = ops.add_rms_norm(x, layer.o(attn), layer.post_norm, eps)
            delta = layer.down(ops.silu_mul(layer.gate_up(hs)))
        x = ops.add_rms_norm(x[logits_rows], delta[logits_rows], self.norm, eps)
        return self.lm_head(x)
