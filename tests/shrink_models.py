"""Small models that go non-finite for real, for the shrink tests.

A module of its own (not a test file) so that a fixture's generated test,
run by pytest in a fresh process, can import these classes by their path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanrunbook.capture.torch import probe


class Normalise(nn.Module):
    """Per-example standardisation written by hand: a constant row has std 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class NormNet(nn.Module):
    def __init__(self, features: int = 8, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.norm = Normalise()
        self.body = nn.Sequential(nn.Linear(features, width), nn.ReLU(inplace=True))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.norm(x)))


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class Attention(nn.Module):
    """Softmax attention written by hand, without subtracting the row maximum."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.exp = Exp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        weights = self.exp(scores)
        weights = weights / weights.sum(-1, keepdim=True)
        return weights @ self.v(x)


class AttnNet(nn.Module):
    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.attn = Attention(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x).mean(1))


class L2Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(-1, keepdim=True))


class SqrtNet(nn.Module):
    def __init__(self, features: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features, bias=False)
        self.norm = L2Norm()
        self.head = nn.Linear(features + 1, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = self.proj(x)
        return self.head(torch.cat([feats, self.norm(feats)], -1))


class MLP(nn.Module):
    def __init__(self, features: int = 8, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def xent(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def xent_bf16(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def xent_fp16(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def batch_of(x: torch.Tensor, classes: int, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"x": x, "y": torch.randint(0, classes, (x.shape[0],), generator=g)}


class FunctionalAttention(nn.Module):
    """The same attention with exp written inline: no module marks it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        weights = torch.exp(scores)
        return (weights / weights.sum(-1, keepdim=True)) @ self.v(x)


class FunctionalAttnNet(nn.Module):
    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.attn = FunctionalAttention(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x).mean(1))


def bce_by_hand(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Binary cross-entropy written by hand: log(1 - p) is -inf once p rounds to 1."""
    p = torch.sigmoid(model(batch["x"])[:, 0])
    y = batch["y"].float().clamp(max=1)
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def siamese_distance(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A contrastive loss on Euclidean distances: sqrt at a zero distance."""
    distance = ((model(batch["x"]) - model(batch["x2"])) ** 2).sum(1).sqrt()
    return (distance**2 + torch.relu(1.0 - distance) ** 2).mean()


class BatchNormNet(nn.Module):
    """Batch norm ahead of the hand-written normalisation: examples interact."""

    def __init__(self, features: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(features)
        self.norm = Normalise()
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.bn(x)))


class Similarity(nn.Module):
    """In-batch negatives: exp of every pair's negated dot product."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(z @ z.T))


class PairNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Similarity()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.sim(z)


def pair_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch["z"]).mean() + 0 * batch["w"].sum()


class GuardedNormalise(nn.Module):
    """Normalisation behind a data-dependent branch: torch.export cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x.abs() > 1e6).any()):
            x = x.clamp(-1e6, 1e6)
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class GuardedNet(nn.Module):
    def __init__(self, features: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.norm = GuardedNormalise()
        self.head = nn.Linear(features, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


class ProbedAttention(FunctionalAttention):
    """The inline exp marked by a named probe, as model code would mark it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = probe("attn.scores", self.q(x) @ self.k(x).transpose(-1, -2))
        weights = probe("attn.weights", torch.exp(scores))
        return (weights / weights.sum(-1, keepdim=True)) @ self.v(x)


class ProbedAttnNet(FunctionalAttnNet):
    def __init__(self, dim: int = 8, classes: int = 3) -> None:
        super().__init__(dim, classes)
        self.attn = ProbedAttention(dim)
