"""Fixtures of the adapter-file tests: a tiny Wan-like model and seeded adapter pairs for it,
used by the scale-source and config checks (a module's own `model` fixture wins)."""
import pytest
import torch
from testkit.fixtures import TinyWanLike, make_adapter_tensors
from testkit.scale_checks import R


@pytest.fixture
def model():
    return TinyWanLike(dtype=torch.float32)


@pytest.fixture
def pairs(model):
    return make_adapter_tensors(model, r=R, seed=7, scale=0.3)
