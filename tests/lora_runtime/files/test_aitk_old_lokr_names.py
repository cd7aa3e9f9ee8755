"""ai-toolkit's LoKr files in its old naming load exactly like the same factors in its current one.

Until ai-toolkit switched LoKr to its PEFT-style dotted names, it wrote ``lycoris_`` + the
diffusers module path with '_' for '.', and then ran each model's own renames, which look for
dotted names. On Wan only part of them apply: ``attn1``/``attn2`` -> ``self_attn``/``cross_attn``
and ``to_q``... -> ``q``..., while ``to_out_0`` and ``ffn_net_*`` stay diffusers
(``lycoris_blocks_0_self_attn_to_out_0``). Flux.1 and Qwen-Image keep their diffusers names,
Flux 2 its BFL ones. The tables below are those facts written out by hand (nothing here calls
the resolver); the files are built at test time.

Each file: every key applied (none left over), the same update objects as the current-naming
file (merged weights and exact-tier outputs bit-identical), the fp64 reference from the factors
(merge: a few fp32 ulps of |W|; dynamic: rel 1e-5, fp32 sums over <= 128 terms), and not the
base weights."""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import (AdapterFormatError, AdapterMatchError, AdapterSpec, applied, load_adapter,
                                               match_adapter, plan)

from comfyui_lora_runtime.lora_runtime.files.dialects import dialect_name

from testkit.dialect_models import MODELS, flux_layers, linear_names, qwen_layers, wan_layers

# Wan: the diffusers module's tail -> the old file's tail (after "lycoris_blocks_N_")
_WAN_OLD = {"attn1.to_q": "self_attn_q", "attn1.to_k": "self_attn_k", "attn1.to_v": "self_attn_v",
            "attn1.to_out.0": "self_attn_to_out_0",
            "attn2.to_q": "cross_attn_q", "attn2.to_k": "cross_attn_k", "attn2.to_v": "cross_attn_v",
            "attn2.to_out.0": "cross_attn_to_out_0",
            "attn2.add_k_proj": "cross_attn_k_img", "attn2.add_v_proj": "cross_attn_v_img",
            "ffn.net.0.proj": "ffn_net_0_proj", "ffn.net.2": "ffn_net_2"}


def _wan_old(diffusers_name: str) -> str:
    if diffusers_name.startswith("blocks."):
        _, i, tail = diffusers_name.split(".", 2)
        return f"lycoris_blocks_{i}_{_WAN_OLD[tail]}"
    return "lycoris_" + diffusers_name.replace(".", "_")   # top-level names: no rename applies


def _layers(family: str, model):
    """[(old stem, current stem, native module, rows | None, swap halves)] for every Linear."""
    if family == "Flux":      # Flux.1 / Kontext: diffusers' FluxTransformer2DModel
        return [("lycoris_" + f.replace(".", "_"), "transformer." + f, n, rows, swap)
                for f, n, rows, swap in flux_layers(model, "diffusers")]
    if family == "Flux 2":    # ai-toolkit's own Flux 2 model: BFL names, blocks only
        return [("lycoris_" + n.replace(".", "_"), "diffusion_model." + n, n, None, False)
                for n in linear_names(model) if n.startswith(("double_blocks.", "single_blocks."))]
    if family == "Qwen-Image":
        return [("lycoris_" + f.replace(".", "_"), "diffusion_model." + f, n, rows, swap)
                for f, n, rows, swap in qwen_layers(model, "diffusers")]
    assert family == "Wan"
    return [(_wan_old(f), "diffusion_model." + n, n, rows, swap) for f, n, rows, swap in wan_layers(model, "diffusers")]


def _split(n: int) -> tuple[int, int]:
    """n = m * k with m <= k as close as possible (the smaller Kronecker side first)."""
    m = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
    return m, n // m


def _lokr(out_f: int, in_f: int, full: bool, g) -> tuple[dict, torch.Tensor]:
    """(LoKr tensors as ai-toolkit saves them, dense delta float64). Full: lokr_w1 + lokr_w2 and its
    'full rank' alpha 9999999999 (bf16), which is ignored (scale 1); else lokr_w2_a/_b of rank 2
    with alpha 1 (scale 1/2)."""
    (a, c), (b, d) = _split(out_f), _split(in_f)
    w1 = torch.randn(a, b, generator=g)
    if full:
        w2 = torch.randn(c, d, generator=g) * 0.1
        t = {"lokr_w1": w1, "lokr_w2": w2, "alpha": torch.tensor(9999999999.0).to(torch.bfloat16)}
        return t, torch.kron(w1.double(), w2.double())
    w2a, w2b = torch.randn(c, 2, generator=g) * 0.3, torch.randn(2, d, generator=g) * 0.3
    t = {"lokr_w1": w1, "lokr_w2_a": w2a, "lokr_w2_b": w2b, "alpha": torch.tensor(1.0)}
    return t, 0.5 * torch.kron(w1.double(), w2a.double() @ w2b.double())


def _files(tmp_path, family: str, model, seed: int = 0):
    """(old-naming file, current-naming file, {native: expected dense delta float64})."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    old, new, expected = {}, {}, {}
    for i, (old_stem, new_stem, native, rows, swap) in enumerate(_layers(family, model)):
        out_f, in_f = mods[native].weight.shape
        lo, hi = rows if rows is not None else (0, out_f)
        t, d = _lokr(hi - lo, in_f, full=i % 2 == 0, g=g)
        for part, v in t.items():
            old[f"{old_stem}.{part}"] = v
            new[f"{new_stem}.{part}"] = v
        if swap:
            d = torch.cat([d[d.shape[0] // 2:], d[:d.shape[0] // 2]])
        expected.setdefault(native, torch.zeros(out_f, in_f, dtype=torch.float64))[lo:hi] += d
    po, pn = tmp_path / f"{family}_old.safetensors", tmp_path / f"{family}_new.safetensors"
    save_file(old, str(po))
    save_file(new, str(pn))
    return po, pn, expected


def _model(family: str):
    return MODELS[family]()


FAMILIES = ["Flux", "Flux 2", "Qwen-Image", "Wan"]
LABELS = {"Flux": "Flux LyCORIS (SimpleTuner)", "Qwen-Image": "Qwen-Image LyCORIS (SimpleTuner)",
          "Wan": "Wan ai-toolkit LoKr (old)"}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_old_key_is_applied_to_the_module_the_current_name_names(tmp_path, family):
    model = _model(family)
    po, pn, expected = _files(tmp_path, family, model)
    lo, cov_o = match_adapter(load_adapter(po), model)
    ln, cov_n = match_adapter(load_adapter(pn), model)
    assert cov_o.unmatched == {} and cov_o.keys_applied == cov_o.keys_total
    assert set(lo) == set(ln) == set(expected)
    assert cov_o.kinds == cov_n.kinds
    if family in LABELS:
        assert cov_o.format.startswith(LABELS[family]), cov_o.format
        stems = sorted(load_adapter(po).layers)
        assert dialect_name(stems) == LABELS[family]   # from the names alone, too
    for name in expected:   # the same update, bit for bit
        assert torch.equal(lo[name].update.delta(), ln[name].update.delta()), name


@pytest.mark.parametrize("mode,tier", [("merge", "exact"), ("dynamic", "exact"), ("dynamic", "lossless")])
@pytest.mark.parametrize("family", FAMILIES)
def test_old_names_apply_exactly_like_the_current_names(tmp_path, family, mode, tier):
    model = _model(family)
    po, pn, expected = _files(tmp_path, family, model, seed=1)
    mods = dict(model.named_modules())
    base = {n: mods[n].weight.detach().clone() for n in expected}
    xs = {n: torch.randn(3, mods[n].in_features, generator=torch.Generator().manual_seed(7)) for n in expected}
    got = {}
    for which, path in (("old", po), ("new", pn)):
        with torch.no_grad(), applied(model, plan(model, [AdapterSpec(str(path))], mode, tier),
                                      fusion_backend=None) as rep:
            assert rep.coverage[0].keys_applied == rep.coverage[0].keys_total
            got[which] = {n: (mods[n].weight.detach().clone() if mode == "merge" else mods[n](xs[n]))
                          for n in expected}
        for n in expected:   # restored bit for bit
            assert torch.equal(mods[n].weight, base[n]), n
    for n, want in expected.items():
        assert torch.equal(got["old"][n], got["new"][n]), n    # the same updates, the same path: the same bits
        if mode == "merge":
            d = got["old"][n].double() - base[n].double()
            tol = 4 * torch.finfo(torch.float32).eps * base[n].abs().max().item() + 1e-6 * want.abs().max().item()
            assert (d - want).abs().max().item() <= tol, n
            assert not torch.equal(got["old"][n], base[n]), n   # the wrong answer: nothing applied
        else:
            y0 = F.linear(xs[n], base[n], mods[n].bias)
            ref = xs[n].double() @ want.T
            y = got["old"][n].double() - y0.double()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-5, n
            assert (y.norm() / ref.norm()).item() > 0.5, n       # the adapter is there at all


def test_old_wan_names_differ_from_the_current_ones_where_renames_were_skipped():
    """The names this file tests are the mixed ones (not the current naming written flat)."""
    old = {_wan_old(f) for f, n, _, _ in wan_layers(MODELS["Wan"](), "diffusers")}
    assert "lycoris_blocks_0_self_attn_to_out_0" in old and "lycoris_blocks_1_cross_attn_to_out_0" in old
    assert "lycoris_blocks_0_ffn_net_0_proj" in old and "lycoris_blocks_0_self_attn_q" in old
    assert not any(s.endswith(("_self_attn_o", "_attn1_to_out_0", "_ffn_0")) for s in old)


@pytest.mark.parametrize("stem", ["lycoris_blocks_0_self_attn_to_out_1",    # no such module
                                  "lycoris_blocks_7_cross_attn_to_out_0",   # a block the model lacks
                                  "lycoris_transformer_1_blocks_0_self_attn_q"])   # a combined 2-expert file
def test_a_leftover_old_name_is_refused_naming_the_key(tmp_path, stem):
    model = MODELS["Wan"]()
    why = ("names transformer_1, the high-noise expert of a file holding both Wan 2.2 experts"
           if "transformer_1" in stem else "no such layer in the model")
    snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
    po, _, _ = _files(tmp_path, "Wan", model, seed=2)
    from safetensors.torch import load_file
    t = load_file(str(po))
    t[f"{stem}.lokr_w1"] = torch.ones(4, 4)
    t[f"{stem}.lokr_w2"] = torch.ones(8, 8)
    bad = tmp_path / "leftover.safetensors"
    save_file(t, str(bad))
    for mode in ("merge", "dynamic", "auto"):
        with pytest.raises(AdapterMatchError, match=rf"leftover\.safetensors.*{stem} \({why}"):
            with applied(model, plan(model, [AdapterSpec(str(bad))], mode, "exact"), fusion_backend=None):
                pass
        for k, v in model.state_dict().items():
            assert torch.equal(v, snap[k]), k
    # "skip and report": the rest applies, the key is named on the report
    _, cov = match_adapter(load_adapter(bad), model, lenient=True)
    assert list(cov.unmatched) == [stem] and cov.unmatched_tensors == 2


def test_full_rank_lokr_saved_as_float16_has_alpha_inf_and_loads_as_with_the_bf16_alpha(tmp_path):
    """ai-toolkit's 'full rank' LoKr stores alpha 9999999999; saved as float16 (its YAML default)
    that is inf. Both factors are full, so alpha is not used (ComfyUI: dim None -> alpha 1.0):
    the file applies as its bf16 twin, with a note on the report. An inf alpha where alpha is
    used, or a NaN, is still refused naming the file and the key."""
    model = MODELS["Wan"]()
    _, pn, _ = _files(tmp_path, "Wan", model, seed=3)
    from safetensors.torch import load_file
    t = load_file(str(pn))
    full = [k[:-len(".lokr_w2")] for k in t if k.endswith(".lokr_w2")]
    assert full
    f16 = dict(t)
    for s in full:
        f16[f"{s}.alpha"] = torch.tensor(9999999999.0).to(torch.float16)
        assert torch.isposinf(f16[f"{s}.alpha"])
    save_file(f16, str(tmp_path / "f16.safetensors"))
    a16, abf = load_adapter(tmp_path / "f16.safetensors"), load_adapter(pn)
    assert any("alpha = inf" in n and "not used" in n for n in a16.notes)
    assert not any("alpha = inf" in n for n in abf.notes)
    assert a16.scale_source == abf.scale_source
    l16, cov = match_adapter(a16, model)
    lbf, _ = match_adapter(abf, model)
    assert cov.unmatched == {} and cov.keys_applied == cov.keys_total
    for name in lbf:
        assert torch.equal(l16[name].update.delta(), lbf[name].update.delta()), name
    # where alpha is used (a factorised LoKr), inf is damage; so is NaN anywhere
    used = next(k[:-len(".lokr_w2_b")] for k in t if k.endswith(".lokr_w2_b"))
    for stem, val in ((used, float("inf")), (full[0], float("nan")), (full[0], float("-inf"))):
        bad = dict(t)
        bad[f"{stem}.alpha"] = torch.tensor(val)
        save_file(bad, str(tmp_path / "bad.safetensors"))
        with pytest.raises(AdapterFormatError, match=rf"bad\.safetensors: tensor '{stem}\.alpha' contains NaN or Inf"):
            load_adapter(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("style", ["lycoris_transformer_{e}_blocks_0_self_attn_q", "diffusion_model.transformer_{e}.blocks.0.self_attn.q"])
def test_a_file_holding_both_wan22_experts_is_refused_saying_so(tmp_path, style):
    """ai-toolkit with split_multistage_loras off writes both Wan 2.2 14B experts in one file
    (old LoKr names and current ones). A ComfyUI model is one expert: the error says which expert
    each key names, not 'an adapter for another model'."""
    model = MODELS["Wan"]()
    snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
    t = {}
    for e in (1, 2):
        stem = style.format(e=e)
        t[f"{stem}.lokr_w1"] = torch.ones(4, 4)
        t[f"{stem}.lokr_w2"] = torch.ones(8, 8)
    save_file(t, str(tmp_path / "both.safetensors"))
    with pytest.raises(AdapterMatchError, match=r"both\.safetensors: none of its 2 adapter layers can be applied: "
                                                r".*transformer_1.*\(names transformer_1, the high-noise expert.*"
                                                r"transformer_2.*\(names transformer_2, the low-noise expert"):
        with applied(model, plan(model, [AdapterSpec(str(tmp_path / "both.safetensors"))], "auto", "exact"),
                     fusion_backend=None):
            pass
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k]), k
