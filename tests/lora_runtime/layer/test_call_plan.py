"""Call plans: a planned call gives the same bits as the general path (the per-call selection every
call made before plans), in every tier and slot mix; a plan is built once per slot state, context
and dtype, and a sampling's model calls with equal factors share one context (one plan)."""
import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, runtime_context
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.layer import call_plan
from comfyui_lora_runtime.lora_runtime.layer.general_path import forward_general, select
from comfyui_lora_runtime.lora_runtime.layer.runtime_context import current_context
from comfyui_lora_runtime.lora_runtime.layer.schedule import Branch, SamplingSchedules, parse_schedule

from testkit.fixtures import lora_pair


def _layer(dtype, n=2, strengths=(0.7, -0.6), diff_b=False):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 48).to(dtype)
    w = AdaptedLayer(lin, "l")
    for i in range(n):
        down, up = lora_pair(48, 32, 4, i + 1, scale=0.3, dtype=dtype)
        db = torch.randn(48, generator=torch.Generator().manual_seed(9)).to(dtype) * 0.1 if diff_b and i == 0 else None
        w.add_adapter(f"s{i}", LayerAdapter("l", down, up, alpha=2.0 * (i + 1), diff_b=db), strengths[i])
    return w, lin


def _general(w, lin, x):
    ctx = current_context()
    return forward_general(w, x, lin(x), ctx, select(w, ctx))


CASES = [  # (adapters, strengths, per-call factors, diff_b): uniform, per-rank, exact, masks, offsets
    (1, (0.8,), None, False),
    (2, (0.7, 0.7), None, False),
    (2, (0.7, -0.6), None, False),
    (2, (0.7, -0.6), {"s0": (0.5, None)}, False),
    (2, (0.7, -0.6), {"s0": (0.0, None)}, False),
    (2, (0.7, -0.6), {"s1": (1.0, torch.tensor([1.0, 0.0]))}, False),
    (2, (0.7, -0.6), None, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", ["exact", "lossless", "high"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_planned_call_is_the_general_path_bitwise(dtype, tier, case):
    n, strengths, adapters, diff_b = CASES[case]
    w, lin = _layer(dtype, n, strengths, diff_b)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad(), runtime_context(tier=tier, adapters=adapters):
        base = lin(x)
        for _ in range(2):  # the second call runs the cached plan
            got = w(x)
            assert torch.equal(got, _general(w, lin, x))
        assert not torch.equal(got, base)  # the adapters are live


def test_plan_is_built_once_per_state_and_context(monkeypatch):
    built = []
    real = call_plan.build
    monkeypatch.setattr(call_plan, "build", lambda *a: built.append(a[1]) or real(*a))
    w, lin = _layer(torch.float32)
    x = torch.randn(3, 32)
    with torch.no_grad():
        with runtime_context(tier="lossless"):
            for _ in range(5):
                w(x)
        assert len(built) == 1
        with runtime_context(tier="lossless"):  # equal settings: the same (interned) context
            w(x)
        assert len(built) == 1
        with runtime_context(tier="exact"):
            w(x)
        assert len(built) == 2
        w.set_strength("s0", 0.3)  # a slot change drops the plans
        with runtime_context(tier="lossless"):
            y = w(x)
        assert len(built) == 3
        with runtime_context(tier="lossless"):
            assert torch.equal(y, _general(w, lin, x))  # the new strength is in the new plan


def test_model_calls_with_equal_factors_share_one_context():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    s = SamplingSchedules({"a": (parse_schedule("1, 1, 0.5, 0.5"), Branch.POSITIVE)}, sigmas)
    first = s.call_scales(1.0, [1, 0], 4, "cpu")
    assert s.call_scales(0.75, [1, 0], 4, "cpu") is first          # step 2, same factor and mask
    third = s.call_scales(0.5, [1, 0], 4, "cpu")
    assert third is not first and third["a"][0] == 0.5 and third["a"][1] is first["a"][1]
    assert torch.equal(first["a"][1], torch.tensor([0.0, 0.0, 1.0, 1.0]))  # negative rows first
    with runtime_context(adapters=first) as c1, runtime_context(adapters=s.call_scales(0.75, [1, 0], 4, "cpu")) as c2:
        assert c1 is c2


@pytest.mark.parametrize("adapters,scale_dim", [(None, 1), ({"s0": (0.5, None)}, 1),
                                                ({"s0": (1.0, torch.tensor([1.0, 0.0]))}, 2)],
                         ids=["unscheduled", "scheduled", "per_branch"])
def test_fused_factors_are_built_once_per_plan(adapters, scale_dim):
    """The fused route reads its factors off the call plan: repeated calls in one context get the
    very same factor tensors (built once), equal to a fresh build."""
    from comfyui_lora_runtime.lora_runtime.fusion.fusion_sites import lora_factors
    w, lin = _layer(torch.float32)
    x = torch.randn(2, 3, 32)
    with torch.no_grad(), runtime_context(tier="lossless", adapters=adapters):
        got = [lora_factors(w, x) for _ in range(5)]
        builds = {tuple(id(t) for t in st) for st in got}  # the results stay alive: ids are distinct
        assert len(builds) == 1, f"{len(builds)} factor builds for 5 fused calls"
        w.drop_plans()
        fresh = lora_factors(w, x)
    for a, b in zip(got[0], fresh):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert torch.as_tensor(got[0][2]).dim() == scale_dim  # per rank (the slots differ), or per row and rank
