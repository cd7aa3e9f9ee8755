"""Restore memory 'copy': a merge keeps a full copy of the weight; restore is a copy.

Same merged bits as the lean record (one fp32 rounding), bit-exact restore, nothing left
modified on a non-finite value or an interrupt part-way, and the node option reaches the
wrappers. The lean record is the wrong answer for the memory figure (it keeps far less).
"""
import pytest
import torch

from comfyui_lora_runtime.lora_runtime import AdaptedLayer, NonFiniteMergeError, RestoreError
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.layer.merge import merge_weight, restore_weight

from testkit.fixtures import wrapped_lora_linear as _wrapped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_merges_the_same_bits_and_restores_bit_exact(dtype):
    lean, copy = _wrapped(dtype=dtype, rel=0.03), _wrapped(dtype=dtype, rel=0.03)
    before = copy.weight.detach().clone()
    copy.restore_copy = True
    lean.merge()
    copy.merge()
    assert torch.equal(copy.weight, lean.weight)       # the same one rounding of fp32(W) + dW
    assert not torch.equal(copy.weight, before)        # the update is in the weight
    rec = copy.merge_state.restore
    full = before.numel() * before.element_size()
    assert rec.kind == "full" and rec.nbytes == full
    assert lean.merge_state.restore.kind == "sparse" and lean.merge_state.restore.nbytes < full / 10  # what lean saves
    copy.unmerge()
    assert torch.equal(copy.weight, before) and copy.restore_bytes == 0


def test_copy_no_drift_over_200_cycles():
    w = _wrapped(out_f=64, in_f=64, r=8, rel=0.1)
    w.restore_copy = True
    before = w.weight.detach().clone()
    for _ in range(200):
        w.merge()
        w.unmerge()
    assert torch.equal(w.weight, before)


def test_copy_catches_non_finite_before_leaving_anything_written():
    lin = torch.nn.Linear(8, 8).to(torch.float16)
    huge = LayerAdapter("l", down=torch.full((1, 8), 300.0), up=torch.full((8, 1), 300.0))
    w = AdaptedLayer(lin, "blocks.0.ffn.0")
    w.restore_copy = True
    w.add_adapter("huge.safetensors", huge, 1.0)
    before = w.weight.detach().clone()
    with pytest.raises(NonFiniteMergeError, match=r"blocks.0.ffn.0.*\[0, 0\].*no weight was changed"):
        w.merge()
    assert torch.equal(w.weight, before) and not w.merged


def test_copy_keeps_a_weight_that_was_already_non_finite():
    """A weight holding inf before the merge is not the merge's fault: it merges and restores."""
    w = torch.randn(40, 16).to(torch.bfloat16)
    w[3, 5] = float("inf")
    before = w.clone()
    d = torch.randn(40, 16) * 0.01
    rec = merge_weight(w, lambda r: d[r], what="t", keep_copy=True, chunk_bytes=16 * 16 * 8)
    assert torch.isinf(w[3, 5]) and not torch.equal(w, before)
    restore_weight(w, rec, lambda r: d[r], what="t")
    assert torch.equal(w, before)


@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_copy_interrupted_part_way_leaves_the_weight_untouched(fail_at):
    w = torch.randn(300, 50).to(torch.bfloat16)
    before = w.clone()
    d = torch.randn(300, 50) * 0.05
    calls = []

    def delta_rows(r):
        calls.append(r)
        if len(calls) > fail_at:
            raise KeyboardInterrupt
        return d[r]

    with pytest.raises(KeyboardInterrupt):
        merge_weight(w, delta_rows, what="t", keep_copy=True, chunk_bytes=50 * 16 * 7)  # 7 rows per chunk
    assert torch.equal(w, before)


def test_copy_restore_refuses_a_recast_weight():
    """A copy restore is still checked: a weight recast while merged is refused, not overwritten."""
    w = torch.randn(30, 20).to(torch.bfloat16)
    d = torch.randn(30, 20) * 0.05
    rec = merge_weight(w, lambda r: d[r], what="layer.q", keep_copy=True)
    with pytest.raises(RestoreError, match="layer.q"):
        restore_weight(w.float(), rec, lambda r: d[r], what="layer.q")


def test_a_copy_swap_takes_the_copy_the_restore_wrote_back():
    """Restore then merge in one transition (a swap): the merge keeps the copy the restore
    just verified instead of writing a new one, and writes the same bits as a fresh merge."""
    w, fresh = _wrapped(rel=0.03), _wrapped(rel=0.03)
    w.restore_copy = fresh.restore_copy = True
    before = w.weight.detach().clone()
    w.merge()
    first = w.merge_state.restore.full
    w.unmerge(remember=True)
    assert torch.equal(w.weight, before)
    w.set_strength("a", 0.4)          # the swapped-in state: another delta
    fresh.set_strength("a", 0.4)
    w.merge()
    fresh.merge()
    assert w.merge_state.restore.full is first                     # no second copy written
    assert torch.equal(w.weight, fresh.weight)          # the same merge bits as without the reuse
    assert not torch.equal(w.weight, before)
    w.unmerge()
    assert torch.equal(w.weight, before)
    # without remember (not a swap) nothing is reused
    w.merge()
    second = w.merge_state.restore.full
    w.unmerge()
    w.merge()
    assert w.merge_state.restore.full is not second
    w.unmerge()
    assert torch.equal(w.weight, before)


def test_a_reused_copy_still_puts_everything_back_when_the_merge_fails_part_way():
    w = torch.randn(300, 50).to(torch.bfloat16)
    before = w.clone()
    d1, d2 = torch.randn(300, 50) * 0.05, torch.randn(300, 50) * 0.05
    rec = merge_weight(w, lambda r: d1[r], what="t", keep_copy=True)
    fp = restore_weight(w, rec, lambda r: d1[r], what="t")
    calls = []

    def delta_rows(r):
        calls.append(r)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return d2[r]

    with pytest.raises(KeyboardInterrupt):
        merge_weight(w, delta_rows, what="t", keep_copy=True, chunk_bytes=50 * 16 * 7,
                     known_fingerprint=fp, backup=rec.full)
    assert torch.equal(w, before) and torch.equal(rec.full, before)
    with pytest.raises(ValueError, match="verified copy"):
        merge_weight(w, lambda r: d2[r], what="t", keep_copy=True, backup=rec.full)  # no fingerprint: no proof
    assert torch.equal(w, before)
