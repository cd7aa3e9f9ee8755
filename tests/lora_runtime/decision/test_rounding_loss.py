"""Rounding-loss estimate (contracts.md s.2): agrees with a real merge, writes nothing."""
import math

import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, measure_share_lost
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter

from testkit.fixtures import lora_pair


def _wrapped(rel, dtype=torch.bfloat16, out_f=512, in_f=384, r=16, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f).to(dtype)
    down, up = lora_pair(out_f, in_f, r, seed + 3, 1.0)
    k = (rel * lin.weight.float().norm() / (up @ down).norm()).sqrt()
    w = AdaptedLayer(lin, "l")
    w.add_adapter("a", LayerAdapter("l", down=down * k, up=up * k, alpha=8.0), 0.8)
    return w


def _actual_share(w):
    before = w.weight.detach().float().clone()
    d = w.delta_rows(slice(None))
    w.merge()
    share = ((w.weight.float() - before - d).norm() / d.norm()).item()
    w.unmerge()
    return share


def test_estimate_agrees_with_an_actual_merge():
    for rel in (1e-4, 3e-3, 0.05):
        w = _wrapped(rel)
        est = measure_share_lost([w])
        act = _actual_share(w)
        assert math.isclose(est, act, rel_tol=1e-3), (rel, est, act)


def test_sampled_rows_agree_on_a_large_layer():
    w = _wrapped(3e-3, out_f=4096, in_f=256)
    est = measure_share_lost([w], max_rows=1024)
    act = _actual_share(w)
    # an even sample of 1/4 of 1M i.i.d. rounding errors: statistical error ~ 1/sqrt(262144) = 0.2 %
    assert math.isclose(est, act, rel_tol=1e-2), (est, act)


def test_sub_ulp_reads_mostly_lost_and_large_reads_kept():
    assert measure_share_lost([_wrapped(1e-5)]) > 0.9
    assert measure_share_lost([_wrapped(0.5)]) < 0.05


def test_fp32_weights_report_no_loss():
    assert measure_share_lost([_wrapped(1e-5, dtype=torch.float32)]) == 0.0


def test_estimate_writes_nothing():
    w = _wrapped(1e-3)
    before = w.weight.detach().clone()
    v = w.weight._version
    measure_share_lost([w])
    assert torch.equal(w.weight, before) and w.weight._version == v and not w.merged


def test_several_layers_aggregate_by_norm():
    a, b = _wrapped(1e-5, seed=1), _wrapped(0.5, seed=2)
    ea, ra = a.rounding_loss_sums()
    eb, rb = b.rounding_loss_sums()
    both = measure_share_lost([a, b])
    assert math.isclose(both, math.sqrt((ea + eb) / (ra + rb)), rel_tol=1e-12)
    assert measure_share_lost([b]) < both < measure_share_lost([a])


def test_auto_samples_a_bounded_number_of_elements_and_agrees_with_a_merge():
    """auto's measurement reads at most SAMPLE_ELEMENTS of each weight and at most 1/SAMPLE_SHARE of
    its rows while that is MIN_SAMPLE_ELEMENTS or more (32 of 1024 rows of 2048 columns here; 128 rows
    by the element count alone); i.i.d. rounding errors over 2**16 elements: statistical error
    ~0.28 %, the tolerance over 3 of them."""
    from comfyui_lora_runtime.lora_runtime.decision.estimate import (SAMPLE_ELEMENTS, SAMPLE_SHARE, SequentialEstimate,
                                                                     sample_rows)
    w = _wrapped(3e-3, out_f=1024, in_f=2048)
    sel = sample_rows(1024, "cpu", 1024, 2048)
    assert sel.numel() * 2048 <= SAMPLE_ELEMENTS and sel.numel() == 1024 // SAMPLE_SHARE == 32
    est, _ = SequentialEstimate([w]).share("a")
    act = _actual_share(w)
    assert math.isclose(est, act, rel_tol=1e-2), (est, act)
