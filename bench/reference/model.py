"""The TransformerLM of framework/models/transformer_lm.h, op for op, in PyTorch."""
import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def attention_kernel(device_type, dtype, seq_len, head_dim):
    """The kernel framework/models/attention.h's rule picks: "fused" or "explicit"."""
    if device_type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return "fused"
    flags = _cpu_flags()
    native = ({"avx512_bf16", "amx_bf16"} if dtype == torch.bfloat16 else
              {"avx512_fp16", "amx_fp16"}) & flags
    if not native:
        return "fused"
    return "explicit" if seq_len <= 256 else "fused"


def causal_attention(q, k, v, kernel):
    """transformer_lm.cc's causal_attention: the fused kernel, or the explicit softmax."""
    if kernel == "fused":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T, D = q.size(-2), q.size(-1)
    att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = att.masked_fill(mask, float("-inf"))
    att = torch.softmax(att.to(torch.float32), -1).to(v.dtype)
    return torch.matmul(att, v)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_heads, attention="auto"):
        super().__init__()
        self.n_heads = n_heads
        self.attention = attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        H, D = self.n_heads, C // self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in (q, k, v))
        kernel = self.attention
        if kernel == "auto":
            kernel = attention_kernel(q.device.type, q.dtype, T, D)
        y = causal_attention(q, k, v, kernel)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, attention="auto"):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_ff)
        self.fc_proj = nn.Linear(d_ff, d_model)

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        return h + self.fc_proj(F.gelu(self.fc(self.ln2(h)), approximate="tanh"))


class TransformerLM(nn.Module):
    def __init__(self, vocab_size=256, seq_len=128, d_model=256, n_layers=4, n_heads=4, d_ff=1024,
                 attention="auto"):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff, attention)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        residual_std = 0.02 / math.sqrt(2.0 * n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                elif "attn.proj.weight" in name or "fc_proj.weight" in name:
                    p.normal_(0.0, residual_std)
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, tokens):
        T = tokens.size(1)
        pos = torch.arange(T, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)  # tied head
