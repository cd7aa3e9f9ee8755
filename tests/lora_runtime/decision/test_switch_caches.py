"""Quick switching: the fingerprint, the content keys and the caches built on them.

Every cache here must be impossible to serve stale: a changed weight (also one written
through ``.data``, which keeps torch's version counter), a changed adapter file, strength
or dtype each get a fresh measurement, and an answer that changed (an overflow) is seen.
"""
import pytest
import torch

from comfyui_lora_runtime.lora_runtime import (AdapterSpec, DecisionCache, LoraInjector, AdaptedLayer,
                                               NonFiniteMergeError, RestoreError, plan)
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter
from comfyui_lora_runtime.lora_runtime.layer.merge import content_key, fingerprint, merge_weight, restore_weight

from testkit.fixtures import TinyWanLike, make_adapter_tensors, write_kohya


def _bf16(rows=64, cols=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) / cols ** 0.5).to(torch.bfloat16)


def _flip(w, flat_index, delta=1):
    """w with the integer bits of one element moved by `delta` (an ulp step for delta=1)."""
    out = w.clone()
    bits = out.view(-1).view(torch.int16)
    bits[flat_index] += delta
    return out


# --- fingerprint and content key ----------------------------------------------------------
@pytest.mark.parametrize("key", [fingerprint, content_key])
def test_any_single_element_change_changes_the_key(key):
    w = _bf16()
    k0 = key(w)
    assert key(w.clone()) == k0  # content, not storage
    for i in (0, 1, 2, 3, 5, 777, w.numel() - 1):  # every position inside a 64-bit lane
        assert key(_flip(w, i)) != k0, i
        assert key(_flip(w, i, -1)) != k0, i


def test_fingerprint_is_its_documented_definition():
    """Sum of the 64-bit lanes and their sum weighted by 2 * (lane mod 65521) + 1, both mod
    2**64, over more than one 65536-lane block (the blocks must not shift the weights)."""
    w = _bf16(300, 1024)
    lanes = w.view(-1).view(torch.int64).tolist()
    m = (1 << 64) - 1
    ref = (sum(lanes) & m, sum(v * (2 * (j % 65521) + 1) for j, v in enumerate(lanes)) & m)
    assert fingerprint(w) == ref


@pytest.mark.parametrize("lanes", [1, 65520, 65521, 2 * 65521, 2 * 65521 + 3])
def test_fingerprint_definition_holds_at_every_period_boundary(lanes):
    """The lanes are summed per position modulo 65521 first: less than one period, whole
    periods and a partial last period give the documented sums (wrong weights or a lost
    tail lane would not)."""
    g = torch.Generator().manual_seed(lanes)
    w = torch.randint(-2**15, 2**15, (lanes * 4,), generator=g, dtype=torch.int16).view(torch.bfloat16)
    v = w.view(torch.int64).tolist()
    m = (1 << 64) - 1
    ref = (sum(v) & m, sum(x * (2 * (j % 65521) + 1) for j, x in enumerate(v)) & m)
    assert fingerprint(w) == ref
    assert fingerprint(_flip(w, 4 * lanes - 1)) != ref   # the last lane counts


@pytest.mark.parametrize("key", [fingerprint, content_key])
def test_ulp_slips_that_cancel_in_a_plain_sum_are_caught(key):
    """+1 ulp here and -1 ulp at the same lane position elsewhere leave the sum of the bits
    unchanged (the wrong answer a plain checksum gives); the position weights see it."""
    w = _bf16()
    slipped = _flip(_flip(w, 4), 4 + 4 * 50, -1)  # lane position 0 of lanes 1 and 51 (rows 0 and 4)
    plain = lambda t: int(t.view(-1).view(torch.int64).sum())  # noqa: E731
    assert plain(slipped) == plain(w)
    assert key(slipped) != key(w)


def test_content_key_tells_dtype_and_shape_apart_and_element_layouts_work():
    w = _bf16(8, 8)
    assert content_key(w) != content_key(w.view(4, 16))
    assert content_key(w.to(torch.float16)) != content_key(w)
    odd = _bf16(5, 3)  # 3 bf16 per row: no whole 64-bit lanes, the element form
    assert content_key(odd) == content_key(odd.clone()) and content_key(_flip(odd, 7)) != content_key(odd)
    assert fingerprint(odd) == fingerprint(odd.clone()) and fingerprint(_flip(odd, 7)) != fingerprint(odd)


# --- merge / restore paths --------------------------------------------------------------------
def test_non_finite_in_a_late_chunk_puts_back_the_chunks_already_written():
    w = torch.randn(300, 50).to(torch.float16)
    before = w.clone()
    d = torch.randn(300, 50) * 0.05
    d[290, 7] = 1e6  # past fp16's largest value, in the last chunk
    with pytest.raises(NonFiniteMergeError, match=r"t: .*\[290, 7\].*no weight was changed"):
        merge_weight(w, lambda r: d[r], what="t", chunk_bytes=50 * 16 * 7)  # 7 rows per chunk
    assert torch.equal(w, before)


def test_interrupt_mid_merge_puts_back_the_chunks_already_written():
    w = _bf16(300, 50)
    before = w.clone()
    d = torch.randn(300, 50) * 0.05
    calls = []

    def delta_rows(r):
        calls.append(r)
        if len(calls) == 20:
            raise KeyboardInterrupt
        return d[r]

    with pytest.raises(KeyboardInterrupt):
        merge_weight(w, delta_rows, what="t", chunk_bytes=50 * 16 * 7)
    assert torch.equal(w, before)


def test_switch_to_a_full_copy_part_way_restores_bit_for_bit():
    """An update as large as the weight: the misses outgrow a copy after some chunks are
    written; the copy is rebuilt for those chunks from their records."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(400, 64, generator=g).to(torch.bfloat16)
    before = w.clone()
    d = torch.randn(400, 64, generator=g)
    rec = merge_weight(w, lambda r: d[r], what="t", chunk_bytes=64 * 16 * 10)  # 40 chunks
    assert rec.kind == "full" and torch.equal(rec.full, before)
    assert torch.equal(w, (before.float() + d).to(torch.bfloat16))
    restore_weight(w, rec, lambda r: d[r], what="t", chunk_bytes=64 * 16 * 10)
    assert torch.equal(w, before)


def test_restore_after_a_write_into_the_merged_weight_raises():
    w = _bf16(300, 50)
    d = torch.randn(300, 50) * 0.05
    rec = merge_weight(w, lambda r: d[r], what="t")
    i = next(i for i in range(1000, w.numel()) if i not in set(rec.index.tolist()))  # not patched back
    w.view(-1).view(torch.int16)[i] += 100  # something wrote into the merged weight (100 ulps)
    with pytest.raises(RestoreError, match="fingerprint"):
        restore_weight(w, rec, lambda r: d[r], what="t")


def _wrapped(seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(48, 64).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(64, 48, generator=g) / 7)
    w = AdaptedLayer(lin, "layer")
    w.add_adapter("a", LayerAdapter("layer", down=torch.randn(4, 48, generator=g) * 0.1,
                                    up=torch.randn(64, 4, generator=g) * 0.1), 1.0)
    return w


def test_verified_fingerprint_is_reused_only_for_the_untouched_weight():
    w = _wrapped()
    before = w.weight.detach().clone()
    w.merge()
    w.unmerge(remember=True)
    assert w.merge_state.verified is not None and w.merge_state.verified[0] == fingerprint(before)
    w.merge()  # reuses it (the weight is untouched since the restore)
    w.unmerge()
    assert torch.equal(w.weight, before) and w.merge_state.verified is None
    # a wrong remembered fingerprint is used when the identity matches: the restore catches it
    w.merge()
    w.unmerge(remember=True)
    w.merge_state.verified = ((0, 0), w.merge_state.verified[1])
    w.merge()
    with pytest.raises(RestoreError):
        w.unmerge()
    # ... and ignored when the weight was written since (the identity moved on)
    w = _wrapped()
    w.merge()
    w.unmerge(remember=True)
    w.merge_state.verified = ((0, 0), w.merge_state.verified[1])
    with torch.no_grad():
        w.weight.mul_(1.0)
    w.merge()
    w.unmerge()


def test_apply_drops_verified_fingerprints_when_the_transition_ends(tmp_path):
    model = TinyWanLike(dtype=torch.bfloat16)
    ref = TinyWanLike(dtype=torch.bfloat16)
    paths = [write_kohya(tmp_path / f"{n}.safetensors", make_adapter_tensors(ref, r=4, seed=s, scale=0.25), alpha=4.0)
             for n, s in (("a", 1), ("b", 2))]
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    inj = LoraInjector(model)
    plans = [plan(model, [AdapterSpec(str(p), 0.8)], "merge") for p in paths]
    for i in range(6):
        inj.apply(plans[i % 2])
        assert all(w.merge_state.verified is None for w in inj.wrappers.values())
    inj.clear()
    assert all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())


# --- content-keyed caches -------------------------------------------------------------------
@pytest.fixture
def fp16_setup(tmp_path):
    model = TinyWanLike(dtype=torch.float16)
    ref = TinyWanLike()
    path = write_kohya(tmp_path / "a.safetensors", make_adapter_tensors(ref, r=2, seed=1, scale=6.0), alpha=2.0)
    other = write_kohya(tmp_path / "b.safetensors", make_adapter_tensors(ref, r=2, seed=9, scale=6.0), alpha=2.0)
    return model, path, other


def _dyn(model, path, cache, strength=1.0):
    inj = LoraInjector(model)
    try:
        return inj.apply(plan(model, [AdapterSpec(str(path), strength)], "dynamic"), cache)
    finally:
        inj.clear()


def test_dynamic_overflow_check_is_cached_by_content(fp16_setup):
    model, path, other = fp16_setup
    cache = DecisionCache()
    _dyn(model, path, cache)
    assert cache.check_measurements == 1
    _dyn(model, path, cache)
    assert cache.check_measurements == 1                # same weights, file, strength: cached
    _dyn(model, path, cache, strength=0.5)
    assert cache.check_measurements == 2                # another strength: measured
    _dyn(model, other, cache)
    assert cache.check_measurements == 3                # another file: measured
    model.to(torch.bfloat16)
    _dyn(model, path, cache)
    assert cache.check_measurements == 3                # bf16: |dW| <= ~100 cannot overflow, by the bound


def test_small_updates_need_no_overflow_measurement_even_in_fp16(tmp_path):
    """|dW| bounded by the factors below half an fp16 ulp at 65504 (16): no weight can overflow,
    nothing is measured (not even the first time); an update past the bound is measured."""
    model = TinyWanLike(dtype=torch.float16)
    ref = TinyWanLike()
    small = write_kohya(tmp_path / "s.safetensors", make_adapter_tensors(ref, r=2, seed=1, scale=0.3), alpha=2.0)
    large = write_kohya(tmp_path / "l.safetensors", make_adapter_tensors(ref, r=2, seed=1, scale=6.0), alpha=2.0)
    cache = DecisionCache()
    _dyn(model, small, cache)
    assert cache.check_measurements == 0
    _dyn(model, large, cache)
    assert cache.check_measurements == 1


def test_auto_measurement_is_fresh_for_another_dtype(tmp_path):
    model = TinyWanLike(dtype=torch.bfloat16)
    path = write_kohya(tmp_path / "s.safetensors", make_adapter_tensors(TinyWanLike(), r=4, seed=1, scale=0.25),
                       alpha=4.0)
    cache = DecisionCache()
    for dtype, n in ((torch.bfloat16, 1), (torch.bfloat16, 1), (torch.float16, 2)):
        model.to(dtype)
        inj = LoraInjector(model)
        inj.apply(plan(model, [AdapterSpec(str(path), 0.8)], "auto"), cache)
        inj.clear()
        assert cache.measurements == n, dtype


def test_a_changed_weight_is_not_served_the_old_overflow_answer(fp16_setup):
    """The weight is patched in place through .data (as a host's weight patcher does): torch's
    version counter does not move and the storage is the same, yet the check runs again and
    sees that the adapter (|dW| ~ 10-100 here) now overflows fp16."""
    model, path, _ = fp16_setup
    cache = DecisionCache()
    _dyn(model, path, cache)
    layer = model.blocks[0].ffn[0]
    version, ptr = layer.weight._version, layer.weight.data_ptr()
    big = layer.weight.detach().clone()
    big[0, :], big[1, :] = 65504.0, -65504.0  # fp16's largest: any update over half an ulp (16) overflows
    layer.weight.data.copy_(big)
    assert layer.weight._version == version and layer.weight.data_ptr() == ptr
    with pytest.raises(NonFiniteMergeError, match="blocks.0.ffn.0"):
        _dyn(model, path, cache)
    assert cache.check_measurements == 1 and len(cache.checks) == 1  # measured again, and not stored


def test_auto_measurement_is_not_reused_for_a_changed_weight_in_the_same_storage(tmp_path):
    """The auto cache used to key weights by storage address: a weight rewritten in place was
    served the old share. Now the key is the content: a fresh measurement, its own answer."""
    model = TinyWanLike(dtype=torch.bfloat16)
    ref = TinyWanLike()
    path = write_kohya(tmp_path / "s.safetensors", make_adapter_tensors(ref, r=4, seed=1, scale=0.25), alpha=4.0)
    cache = DecisionCache()
    inj = LoraInjector(model)
    p = plan(model, [AdapterSpec(str(path), 0.8)], "auto")
    r1 = inj.apply(p, cache)
    inj.clear()
    r2 = inj.apply(p, cache)
    inj.clear()
    assert cache.measurements == 1 and r2.decision.cached
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.dim() == 2:
                prm.data.copy_(prm.data * 64)  # same storage; the update is now far below a bf16 ulp
    r3 = inj.apply(p, cache)
    inj.clear()
    assert cache.measurements == 2 and not r3.decision.cached
    assert r3.decision.share_lost > 4 * r1.decision.share_lost


def test_adapters_without_a_content_digest_are_never_cached():
    w = _wrapped()
    from comfyui_lora_runtime.lora_runtime.decision.policy import decide
    from comfyui_lora_runtime.lora_runtime.settings import MergeMode
    cache = DecisionCache()
    decide(MergeMode.DYNAMIC, [w], cache)
    decide(MergeMode.AUTO, [w], cache)
    assert cache.checks == {} and cache.shares == {} and cache.measurements == 0


def test_the_cache_is_bounded():
    cache = DecisionCache(max_entries=3)
    for i in range(5):
        cache._put(cache.checks, i, True)
    assert list(cache.checks) == [2, 3, 4]
