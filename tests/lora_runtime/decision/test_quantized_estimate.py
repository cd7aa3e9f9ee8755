"""`auto`'s measurement on quantized weights: a row sample re-quantized at the whole merge's scale,
cheaply (real comfy-kitchen ``QuantizedTensor`` weights in the bundled host's layer shape).

References: the whole merge's largest |value| and the same measurement over every row. Wrong
answers: the sample's own largest value (a sample without the rows that may hold the top), and a
share measured without the adapter (0)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("comfy_kitchen")

from comfyui_lora_runtime.standalone.host import quant_checkpoints  # noqa: E402
from comfyui_lora_runtime.lora_runtime import AdaptedLayer  # noqa: E402
from comfyui_lora_runtime.lora_runtime.decision import estimate  # noqa: E402
from comfyui_lora_runtime.lora_runtime.decision.policy import DecisionCache, decide  # noqa: E402
from comfyui_lora_runtime.lora_runtime.files.layer_adapter import LayerAdapter  # noqa: E402
from comfyui_lora_runtime.lora_runtime.layer import base_weight, quantized_rows  # noqa: E402
from comfyui_lora_runtime.lora_runtime.settings import MergeMode  # noqa: E402

LAYOUTS = ["TensorCoreFP8Layout", "TensorCoreFP8E5M2Layout", "TensorWiseINT8Layout", "TensorCoreMXFP8Layout",
           "TensorCoreNVFP4Layout", "TensorCoreConvRotW4A4Layout", "AsymW4A8Int8Layout"]
TENSOR_SCALED = ["TensorCoreFP8Layout", "TensorCoreFP8E5M2Layout", "TensorWiseINT8Layout", "TensorCoreNVFP4Layout"]
ROW_LOCAL = [x for x in LAYOUTS if x not in TENSOR_SCALED]
ROWS, COLS, RANK = 512, 256, 32
TOP = (301, 17)  # the largest weight: a row the even sample does not hold


@pytest.fixture(autouse=True)
def _small_sample(monkeypatch):
    monkeypatch.setattr(estimate, "SAMPLE_ELEMENTS", 32 * COLS)  # 32 of 512 rows: a real sample


def _layer(layout: str, sizes=(0.02,), seed: int = 0) -> AdaptedLayer:
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(COLS, ROWS)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(ROWS, COLS, generator=g) / COLS ** 0.5)
        lin.weight[TOP] = 0.4
    w = AdaptedLayer(quant_checkpoints.quantize_model(nn.Sequential(lin), layout, min_numel=1)[0], "l")
    w.requant_seed = seed
    for i, size in enumerate(sizes):
        down, up = torch.randn(RANK, COLS, generator=g) * size, torch.randn(ROWS, RANK, generator=g) * size
        up[TOP[0]] = size * 4  # the update moves the top value: the merge's scale is not the stored one
        w.add_adapter(f"a{i}", LayerAdapter("l", down=down, up=up), 1.0, content_hash=f"h{i}")
    return w


def _whole(w: AdaptedLayer, names: list[str]) -> list[float]:
    """The largest |value| of W + each run of updates in turn (the whole fp32 sum: one re-quantization
    of it is what a merge of those adapters does)."""
    total, out = w.weight2d.clone(), []
    for name in names:
        total += w.delta_rows(slice(None), [w.slots[name]])
        out.append(float(total.abs().amax()))
    return out


@pytest.mark.parametrize("layout", TENSOR_SCALED)
def test_the_sample_takes_the_whole_merges_scale(layout):
    w = _layer(layout, sizes=(0.02, 0.01))
    est = estimate.SequentialEstimate([w])
    _, after = est.share("a0")
    rows = est.rows["l"]
    even = rows.sel[rows.measured]
    est.advance(after)
    _, after2 = est.share("a1")
    whole = _whole(w, ["a0", "a1"])
    # equal up to the fp32 rounding of the update (its matrix product is blocked by shape)
    assert float(after["l"][1]) == pytest.approx(whole[0], rel=1e-6)
    assert float(after2["l"][1]) == pytest.approx(whole[1], rel=1e-6)
    sample_only = float((w.weight2d[even] + w.delta_rows(even, [w.slots["a0"]])).abs().amax())
    assert sample_only < 0.9 * whole[0]  # the wrong answer: the sample's own top


# (SCREEN_COST, GATHER_COST, DENSE_CHUNK): candidate rows computed whole (the earlier sums at the elements
# found read from the factors, or the rows' sums formed again; in chunks of 8 rows, the base read whole
# and summed onto from the chunk after the first whose sums are formed again), or single elements
# computed one by one
CHUNK = estimate.DENSE_CHUNK
SEARCHES = {"rows whole": (1 << 30, 1 << 30, CHUNK), "rows whole twice": (1 << 30, 0, CHUNK),
            "base read whole": (1 << 30, 0, 8 * COLS), "single elements": (1, 1 << 30, CHUNK)}


def _use_search(monkeypatch, search: str) -> None:
    screen, gather, chunk = SEARCHES[search]
    monkeypatch.setattr(estimate, "SCREEN_COST", screen)
    monkeypatch.setattr(estimate, "GATHER_COST", gather)
    monkeypatch.setattr(estimate, "DENSE_CHUNK", chunk)


def _merged_tops(est, names) -> list[float]:
    """Each adapter measured and merged in turn: the top each measurement took."""
    tops = []
    for name in names:
        _, after = est.share(name)
        tops.append(float(after["l"][1]))
        est.advance(after)
    return tops


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("layout", TENSOR_SCALED)
def test_the_top_outside_the_held_rows_is_found_exactly(layout, search, monkeypatch):
    """Three adapters merged in turn; the first two move the tensor's largest |value| into a row the
    sample does not hold (nor the rows with the largest stored values): each alone does not, their
    sum does, so the third's search must carry the earlier merges' reach. Either search (single
    elements, or the candidate rows computed whole) finds the whole sum's top; the wrong answer is
    the held rows' own largest value."""
    _use_search(monkeypatch, search)
    w = _layer(layout, sizes=(0.02, 0.01, 0.01))
    for name in ("a0", "a1"):  # each adds 0.25 at (77, 5)
        _moves_row(w, name, 0.25)
    est = estimate.SequentialEstimate([w])
    rows = est.rows["l"]
    assert 77 not in rows.sel.tolist()
    searches = _count_searches(monkeypatch)
    tops = _merged_tops(est, ("a0", "a1", "a2"))
    whole = _whole(w, ["a0", "a1", "a2"])
    assert tops == pytest.approx(whole, rel=1e-6)
    assert searches in _one_chain(3)
    total = w.weight2d + w.delta_rows(slice(None), [w.slots[n] for n in ("a0", "a1", "a2")])
    assert int(total.abs().argmax()) // COLS == 77  # the top sits in the row nobody holds
    assert float(rows.summed.abs().amax()) < 0.95 * whole[2]  # the wrong answer: the held rows' top


def _count_searches(monkeypatch) -> list[int]:
    """The number of slots each `_QuantRows._search` call serves (its tops), in call order."""
    calls, real = [], estimate._QuantRows._search

    def spy(self, *args):
        out = real(self, *args)
        calls.append(len(out[0]))
        return out

    monkeypatch.setattr(estimate._QuantRows, "_search", spy)
    return calls


def _one_chain(adapters: int) -> list[list[int]]:
    """The searches of `adapters` measured and merged in the chain's order: one for all of them (carried
    along the first's search where that computes candidate rows whole), or the first's own and one for
    the rest after its merge; never one per adapter."""
    return [[adapters], [1, adapters - 1]]


def _moves_row(w: AdaptedLayer, name: str, by: float, row: int = 77) -> None:
    """Adapter `name` adds `by` at (row, 5), a row with only ordinary stored values (77 by default)."""
    with torch.no_grad():
        u = w.slots[name].update
        u.up[row] = 0.0
        u.up[row, 0] = 1.0
        u.down[0] = 0.0
        u.down[0, 5] = by


MOVES = {"a1 moves it, a2 takes it back": (0.6, -0.6), "only a2 moves it": (None, 0.6)}


@pytest.mark.parametrize("moves", MOVES)
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("layout", TENSOR_SCALED)
def test_each_top_of_one_search_is_found(layout, search, moves, monkeypatch):
    """a0 merges; one search serves a1 and a2, which move (77, 5) to the tensor's top and back, or only
    the second moves it there. Each top sits where only its own sum's bounds and row maxima reach: a
    screen held to one of the two thresholds misses the other's. Reference: the whole sums."""
    _use_search(monkeypatch, search)
    w = _layer(layout, sizes=(0.02, 0.01, 0.01))
    for name, by in zip(("a1", "a2"), MOVES[moves]):
        if by is not None:
            _moves_row(w, name, by)
    est = estimate.SequentialEstimate([w])
    searches = _count_searches(monkeypatch)
    tops = _merged_tops(est, ("a0", "a1", "a2"))
    whole = _whole(w, ["a0", "a1", "a2"])
    assert tops == pytest.approx(whole, rel=1e-6) and searches in _one_chain(3)
    at = [abs(float(w.weight2d[77, 5] + sum(w.delta_rows(torch.tensor([77]), [w.slots[n]])[0, 5]
                                             for n in ("a0", "a1", "a2")[:k + 1]))) for k in (1, 2)]
    moved = [k for k, v in zip((1, 2), at) if v == pytest.approx(whole[k], rel=1e-6)]
    assert moved == ([1] if MOVES[moves][0] else [2])  # the top at (77, 5) in one of the two sums only


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("layout", TENSOR_SCALED)
def test_merges_off_the_chain_are_searched_afresh(layout, search, monkeypatch):
    """a0 merges; a1 is measured (one search for a1, a2, a3, each assumed merged after the last) but
    stays unmerged; a3 is measured next and merges, then a2: each top is then that of W + what did
    merge + it, searched on its own. Wrong answer: the chain's tops, which count a1's move of row 77."""
    _use_search(monkeypatch, search)
    w = _layer(layout, sizes=(0.02, 0.01, 0.01, 0.01))
    _moves_row(w, "a1", 0.6)
    est = estimate.SequentialEstimate([w])
    searches = _count_searches(monkeypatch)
    _, after = est.share("a0")
    est.advance(after)
    est.share("a1")  # not merged
    chain = est.rows["l"]._tops
    tops = _merged_tops(est, ("a3", "a2"))
    want = _whole(w, ["a0", "a3", "a2"])[1:]
    assert tops == pytest.approx(want, rel=1e-6)
    assert searches in ([4, 1, 1], [1, 3, 1, 1])
    a2 = next(i for i, p in enumerate(est.rows["l"]._rest) if p is w.slots["a2"])
    assert chain[a2] == pytest.approx(_whole(w, ["a0", "a1", "a2"])[2], rel=1e-6) and chain[a2] > 1.2 * want[1]


@pytest.mark.parametrize("first_merges", [True, False])
@pytest.mark.parametrize("search", ["rows whole", "rows whole twice", "base read whole"])
@pytest.mark.parametrize("layout", ["TensorCoreFP8Layout", "TensorCoreFP8E5M2Layout", "TensorWiseINT8Layout"])
def test_the_first_search_carries_the_chain_when_it_computes_rows_whole(layout, search, first_merges, monkeypatch):
    """a0 and a1 each move (77, 5) by 0.3, so a0's own search computes candidate rows whole: the rest of
    the chain comes along, one search for all three. Where a0 stays unmerged, a1 and a2 are searched on
    their own against W alone. Reference: the whole sums; wrong answers: the held rows' own top, the
    carried chain's tops where a0 stays unmerged."""
    _use_search(monkeypatch, search)
    w = _layer(layout, sizes=(0.02, 0.01, 0.01))
    for name in ("a0", "a1"):
        _moves_row(w, name, 0.3)
    est = estimate.SequentialEstimate([w])
    searches = _count_searches(monkeypatch)
    merged = ["a0", "a1", "a2"] if first_merges else ["a1", "a2"]
    tops = []
    for name in ("a0", "a1", "a2"):
        _, after = est.share(name)
        if name in merged:
            tops.append(float(after["l"][1]))
            est.advance(after)
    whole = _whole(w, merged)
    assert tops[-len(merged):] == pytest.approx(whole, rel=1e-6)
    assert searches == ([3] if first_merges else [3, 1, 1])
    if first_merges:  # the wrong answer: the held rows' own top
        assert float(est.rows["l"].summed.abs().amax()) < 0.95 * whole[-1]
    else:  # the wrong answer: the carried chain's top for a1, which counts a0's move
        assert est.rows["l"]._tops[1] > 1.2 * whole[0]


@pytest.mark.parametrize("search", ["rows whole", "rows whole twice", "base read whole"])
@pytest.mark.parametrize("layout", ["TensorCoreFP8Layout", "TensorCoreFP8E5M2Layout", "TensorWiseINT8Layout"])
def test_the_carried_chain_reaches_rows_only_a_later_adapter_moves(layout, search, monkeypatch):
    """a0 moves (77, 5) by 0.3, so its own search computes candidate rows whole and carries the chain;
    only a2 moves row 150, by 0.8, which a0's bounds do not let reach a0's floor: the carried search
    must compute it too. Reference: the whole sums; wrong answer: the rows a0's bounds reach, without
    row 150."""
    _use_search(monkeypatch, search)
    w = _layer(layout, sizes=(0.02, 0.01, 0.01))
    _moves_row(w, "a0", 0.3)
    _moves_row(w, "a2", 0.8, row=150)
    est = estimate.SequentialEstimate([w])
    rows = est.rows["l"]
    rest, lows = rows._rest_of(w.slots["a0"])
    assert 150 not in rows.sel.tolist() and not bool(rows._rows_reaching(rest[:1], lows[:1])[0][:, 150].any())
    searches = _count_searches(monkeypatch)
    tops = _merged_tops(est, ("a0", "a1", "a2"))
    whole = _whole(w, ["a0", "a1", "a2"])
    assert tops == pytest.approx(whole, rel=1e-6) and searches == [3]
    total = w.weight2d + w.delta_rows(slice(None), [w.slots[n] for n in ("a0", "a1", "a2")])
    assert int(total.abs().argmax()) // COLS == 150


@pytest.mark.parametrize("search", ["rows whole", "rows whole twice", "base read whole"])
@pytest.mark.parametrize("layout", ["TensorCoreFP8Layout", "TensorCoreFP8E5M2Layout", "TensorWiseINT8Layout"])
def test_a_carried_search_keeps_the_merged_rows_maxima(layout, search, monkeypatch):
    """a0 moves (77, 5) by 0.5 and merges; a1, which takes the move back, is measured off the carried
    chain's rows and stays unmerged; a2 is then searched on its own against W + a0, whose top is at
    (77, 5). The rows' maxima the first search leaves for later bounds are a0's alone (wrong answer:
    those of the whole chain's sum, where a1 took the move back, which would drop row 77)."""
    _use_search(monkeypatch, search)
    w = _layer(layout, sizes=(0.02, 0.01, 0.01))
    _moves_row(w, "a0", 0.5)
    _moves_row(w, "a1", -0.5)
    est = estimate.SequentialEstimate([w])
    searches = _count_searches(monkeypatch)
    _, after = est.share("a0")
    est.advance(after)
    est.share("a1")  # not merged
    _, after = est.share("a2")
    want = _whole(w, ["a0", "a2"])[1]
    assert float(after["l"][1]) == pytest.approx(want, rel=1e-6) and searches == [3, 1]
    total = w.weight2d + w.delta_rows(slice(None), [w.slots["a0"], w.slots["a2"]])
    assert int(total.abs().argmax()) // COLS == 77


@pytest.mark.parametrize("layout", TENSOR_SCALED)
def test_large_updates_read_the_base_whole_after_a_crowded_screen(layout, monkeypatch):
    """Three large updates (each moving rows by about a third of the weight's top), one chain search
    over candidate rows computed whole in 8-row chunks: once a chunk's screen finds more elements than
    its factors may gather, each later chunk's base is read whole and summed onto (no screen); the tops
    still equal the whole sums'. Wrong answer: the base's own top (the updates left out)."""
    _use_search(monkeypatch, "base read whole")
    w = _layer(layout, sizes=(0.06, 0.06, 0.06))
    _moves_row(w, "a2", 0.6)
    reads, real = [], estimate._QuantRows._base

    def spy(self, rows):
        reads.append(rows.numel())
        return real(self, rows)

    monkeypatch.setattr(estimate._QuantRows, "_base", spy)
    est = estimate.SequentialEstimate([w])
    tops = _merged_tops(est, ("a0", "a1", "a2"))
    whole = _whole(w, ["a0", "a1", "a2"])
    assert tops == pytest.approx(whole, rel=1e-6)
    assert sum(n <= 8 for n in reads) >= 10  # most chunks of ~500 candidate rows read whole
    assert float(w.weight2d.abs().amax()) < 0.9 * whole[2]


@pytest.mark.parametrize("layout", TENSOR_SCALED)
def test_the_chain_follows_the_given_order(layout, monkeypatch):
    """Measured in the order a2, a1, a0 (not the slots' own), each merging: the chain made after a2's
    merge serves a1 and a0 with W + a2 + a1's and W + a2 + a1 + a0's tops. Wrong answer: the
    layer's own order, which would leave the chain unused (three searches)."""
    w = _layer(layout, sizes=(0.02, 0.01, 0.01))
    _moves_row(w, "a1", 0.3)
    _moves_row(w, "a0", 0.3)
    order = ["a2", "a1", "a0"]
    est = estimate.SequentialEstimate([w], order=order)
    searches = _count_searches(monkeypatch)
    tops = _merged_tops(est, order)
    assert tops == pytest.approx(_whole(w, order), rel=1e-6)
    assert searches in _one_chain(3)
    total = w.weight2d + w.delta_rows(slice(None), [w.slots[n] for n in order])
    assert int(total.abs().argmax()) // COLS == 77


@pytest.mark.parametrize("layout", ["TensorCoreFP8Layout", "TensorWiseINT8Layout"])
def test_updates_without_low_rank_factors_take_the_rows_whole(layout):
    """A DoRA update (its delta reads the weight) merged, then a full-weight diff measured after it:
    neither has factors to bound, so the search computes the candidate rows whole; the top still
    equals the whole sum's. Wrong answer: the held rows' own top."""
    g = torch.Generator().manual_seed(9)
    w = _layer(layout, sizes=())
    down, up = torch.randn(RANK, COLS, generator=g) * 0.02, torch.randn(ROWS, RANK, generator=g) * 0.02
    magnitude = torch.linalg.vector_norm(w.weight2d, dim=1, keepdim=True) * 1.05
    w.add_adapter("dora", LayerAdapter("l", down=down, up=up, dora_scale=magnitude), 1.0, content_hash="d")
    diff = torch.zeros(ROWS, COLS)
    diff[77, 5] = 0.6  # the top moves into a row nobody holds
    w.add_adapter("diff", LayerAdapter("l", diff=diff), 1.0, content_hash="f")
    assert w.slots["dora"].update.stack() is None and w.slots["diff"].update.stack() is None
    est = estimate.SequentialEstimate([w])
    rows = est.rows["l"]
    tops = _merged_tops(est, ("dora", "diff"))
    assert tops == pytest.approx(_whole(w, ["dora", "diff"]), rel=1e-6)
    assert 77 not in rows.sel.tolist() and float(rows.summed.abs().amax()) < 0.95 * tops[1]


@pytest.mark.parametrize("layout", ROW_LOCAL)
def test_row_local_samples_are_the_whole_merges_rows(layout):
    """mxfp8 and the 4-bit layouts have no scale spanning the tensor: the sampled rows, merged twice in
    turn, are bit for bit those rows of the whole merges (round to nearest); no search, no top."""
    w = _layer(layout, sizes=(0.02, 0.01))
    est = estimate.SequentialEstimate([w])
    rows = est.rows["l"]
    assert isinstance(rows, estimate._LocalRows) and rows.sel.numel() < ROWS
    cur = w.weight2d.clone()
    assert torch.equal(rows.cur, cur[rows.sel])
    for name in ("a0", "a1"):
        _, after = est.share(name)
        exact = cur + w.delta_rows(slice(None), [w.slots[name]])
        cur = w.grid_round(exact)
        assert torch.equal(after["l"], cur[rows.sel])
        assert not torch.equal(after["l"], exact[rows.sel])   # the wrong answer: no rounding
        est.advance(after)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_sampled_share_is_every_rows_share(layout, monkeypatch):
    w = _layer(layout)
    share = decide(MergeMode.AUTO, [w], DecisionCache()).adapters[0].share_lost
    monkeypatch.setattr(estimate, "SAMPLE_ELEMENTS", ROWS * COLS)
    every = decide(MergeMode.AUTO, [w], DecisionCache()).adapters[0].share_lost
    # 32 of 512 rows: a row's |dW|^2 varies with its rank-32 factor row (relative sd sqrt(2/32) =
    # 0.25), so the sampled sum is off by about 0.25/sqrt(32) = 4.4 % and the share by half that;
    # 8 % is over 3 standard deviations
    assert share == pytest.approx(every, rel=0.08)
    assert every > 0.01  # the wrong answer (no adapter, or no rounding) is 0


@pytest.mark.parametrize("layout", ["TensorWiseINT8Layout", "TensorCoreFP8E4M3Layout", "TensorCoreFP8E5M2Layout"])
def test_stochastic_merges_are_measured_by_their_expected_error(layout, monkeypatch):
    """Per-tensor int8 and fp8 merged with the host's stochastic rounding: the share measured over
    every row (the exact expected error of that rounding, no draw) is the share an actual merge of the
    whole weight loses, to 0.5 %: one draw's sum over 131k errors is off its expectation by about
    0.3 %, the share by half that. Rounding to nearest (seed 0), the same rows, bit for bit. Wrong
    answers: the share a round-to-nearest merge loses (about 1/sqrt(2) of it), and none."""
    monkeypatch.setattr(estimate, "SAMPLE_ELEMENTS", ROWS * COLS)
    monkeypatch.setattr(estimate, "SAMPLE_SHARE", 1)
    shares = {}
    for seed in (0, 11):
        w = _layer(layout, seed=seed)
        assert (quantized_rows.expected_rounding(w.get_base_layer().weight, seed) is None) == (seed == 0)
        before, d = w.weight2d.clone(), w.delta_rows(slice(None), [w.slots["a0"]])
        measured = decide(MergeMode.AUTO, [w], DecisionCache()).adapters[0].share_lost
        w.merge()
        actual = float((w.weight2d - before - d).norm() / d.norm())
        w.unmerge()
        assert torch.equal(w.weight2d, before)
        shares[seed] = (measured, actual)
    assert shares[0][0] == pytest.approx(shares[0][1], rel=1e-6)  # the fp32 sums' order
    measured, actual = shares[11]
    assert measured == pytest.approx(actual, rel=0.005)
    assert measured > 1.3 * shares[0][1] > 0.01  # the wrong answer: the round-to-nearest merge's share


@pytest.mark.parametrize("layout", ["TensorCoreFP8Layout", "TensorWiseINT8Layout", "TensorCoreMXFP8Layout",
                                    "TensorCoreNVFP4Layout"])
def test_per_tensor_layouts_never_read_the_whole_weight(layout, monkeypatch):
    """The measurement dequantizes and re-quantizes at most a quarter of the weight's elements
    (what makes it cost a fraction of a merge, which does both to every element), also for a second
    adapter measured after the first merged."""
    sizes = (0.05, 0.04)
    w = _layer(layout, sizes=sizes)
    seen = {"dequantized": 0, "requantized": 0}
    real_dq, real_rq = quantized_rows.dequantized, type(w.get_base_layer().weight).requantize_from_float

    def dq(t, dtype=torch.float32):
        seen["dequantized"] += t.numel()
        return real_dq(t, dtype)

    def rq(self, t, **kw):
        seen["requantized"] += t.numel()
        return real_rq(self, t, **kw)

    def whole(*a, **k):
        raise AssertionError("the whole weight was dequantized")

    monkeypatch.setattr(quantized_rows, "dequantized", dq)
    monkeypatch.setattr(type(w.get_base_layer().weight), "requantize_from_float", rq)
    monkeypatch.setattr(base_weight, "dequantized", whole)
    d = decide(MergeMode.AUTO, [w], DecisionCache())
    assert d.adapters[0].chosen == "merge" and len(d.adapters) == len(sizes)  # a second measured after a merge
    assert 0 < seen["dequantized"] <= ROWS * COLS / 4 and 0 < seen["requantized"] <= 2 * ROWS * COLS / 4


def test_a_changed_quantized_weight_is_measured_afresh():
    w = _layer("TensorCoreFP8Layout")
    cache = DecisionCache()
    decide(MergeMode.AUTO, [w], cache)
    decide(MergeMode.AUTO, [w], cache)
    assert cache.measurements == 1
    w.get_base_layer().weight._qdata.view(torch.uint8)[3, 3] ^= 1  # one stored byte
    decide(MergeMode.AUTO, [w], cache)
    assert cache.measurements == 2
