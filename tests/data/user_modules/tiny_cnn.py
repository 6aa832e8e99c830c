"""A torchvision-style CNN: a stem, a ModuleList of residual stages, a classifier. Its inputs are images, so the
factory returns (module, input_builder) with input_builder(batch, seq) -> the batch of images (seq unused)."""

import torch
import torch.nn as nn


class Stage(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyCNN(nn.Module):
    def __init__(self, c: int = 32, stages: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.stages = nn.ModuleList([Stage(c) for _ in range(stages)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for st in self.stages:
            x = st(x)
        return self.fc(x.mean(dim=(2, 3)))


def make():
    return TinyCNN(), (lambda batch, seq: torch.randn(batch, 3, 32, 32))


def make_without_inputs():
    return TinyCNN()
