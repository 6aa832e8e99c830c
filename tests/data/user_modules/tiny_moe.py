"""A mixture-of-experts LM without transformers: each block routes every token to its top-2 of 4 experts
(a ModuleList per block) through a linear router."""

import torch
import torch.nn as nn


class Expert(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


class MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int = 4, k: int = 2) -> None:
        super().__init__()
        self.norm, self.router, self.k = nn.LayerNorm(d), nn.Linear(d, experts, bias=False), k
        self.experts = nn.ModuleList([Expert(d) for _ in range(experts)])

    def forward(self, x):
        h = self.norm(x)
        weights, chosen = torch.topk(torch.softmax(self.router(h), dim=-1), self.k, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            w = (weights * (chosen == e)).sum(-1, keepdim=True)  # dense dispatch: every token, weighted
            out = out + w * expert(h)
        return x + out


class TinyMoE(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([MoEBlock(d) for _ in range(layers)])
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def make():
    return TinyMoE()
