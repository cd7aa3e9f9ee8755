"""Key dialects (lora_runtime/files/dialects.py) against hand-written tables (_dialect_models.py)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

from comfyui_lora_runtime.lora_runtime.files import dialects as D
from comfyui_lora_runtime.lora_runtime.files import key_formats

from testkit import dialect_models as M
from testkit.fixtures import TinyWanLike, wan_native_to_diffusers

DIALECTS = sorted(M.DIALECT_FILES)


def _model(family):
    return M.MODELS[family]()


@functools.lru_cache(maxsize=None)
def _file(dialect, rank=4, seed=0):
    """(model, modules, tensors, expected, stems); cached: tests only read them."""
    family = M.DIALECT_FILES[dialect][0]
    model = _model(family)
    tensors, expected = M.make_dialect_file(dialect, model, rank, seed)
    stems = sorted({D.split_key(k)[0] for k in tensors})
    return model, dict(model.named_modules()), tensors, expected, stems


def _dense_via_resolver(tensors, mods):
    """A mini-loader: what the wrapper must end up adding, computed through `resolve_all`."""
    by_stem: dict[str, dict] = {}
    for k, t in tensors.items():
        stem, part, _ = D.split_key(k)
        by_stem.setdefault(stem, {})[part] = t
    targets = D.resolve_all(by_stem, mods)
    out: dict[str, torch.Tensor] = {}
    for stem, parts in by_stem.items():
        t = targets[stem]
        assert t is not None, stem
        down, up = parts["down"].double(), parts["up"].double()
        scale = float(parts["alpha"]) / down.shape[0] if "alpha" in parts else 1.0
        d = scale * up @ down
        if t.swap_halves:
            h = d.shape[0] // 2
            d = torch.cat([d[h:], d[:h]])
        w = mods[t.module].weight
        full = out.setdefault(t.module, torch.zeros(tuple(w.shape), dtype=torch.float64))
        lo, hi = t.rows if t.rows is not None else (0, w.shape[0])
        assert d.shape == (hi - lo, w.shape[1]), (stem, d.shape, t)
        full[lo:hi] += d
    return out


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_stem_resolves_to_the_hand_written_target(dialect):
    model, mods, tensors, expected, stems = _file(dialect)
    want = {s: (n, r, sw) for s, n, r, sw in M.dialect_layers(dialect, model)}
    got = D.resolve_all(stems, mods)
    assert set(got) == set(want)
    unmatched = [s for s, t in got.items() if t is None]
    assert not unmatched, unmatched
    for s, t in got.items():
        assert (t.module, t.rows, t.swap_halves) == want[s], s
        assert not t.param
        assert t.dialect == M.DIALECT_FILES[dialect][4], (s, t.dialect)
        # resolve alone (no file context) agrees for these names
        assert D.resolve(s, mods) == t


@pytest.mark.parametrize("dialect", DIALECTS)
def test_dialect_name(dialect):
    _, mods, _, _, stems = _file(dialect)
    label = M.DIALECT_FILES[dialect][4]
    assert D.dialect_name(stems, mods) == label
    assert D.dialect_name(stems) == label            # from the names alone
    assert label in {d.name for d in D.DIALECTS}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_fused_weights_covered_once_without_overlap(dialect):
    model, mods, _, _, stems = _file(dialect)
    targets = list(D.resolve_all(stems, mods).values())
    assert D.overlaps(targets) == []
    rows: dict[str, list] = {}
    for t in targets:
        rows.setdefault(t.module, []).append(t.rows)
    for mod, rs in rows.items():
        out = mods[mod].weight.shape[0]
        if rs == [None]:
            continue
        assert None not in rs, mod
        covered = sorted(rs)
        assert covered[0][0] == 0 and covered[-1][1] <= out
        for a, b in zip(covered, covered[1:]):
            assert a[1] == b[0], (mod, covered)           # contiguous, no gap, no overlap
        if "xlabs" not in M.DIALECT_FILES[dialect][1]:
            assert covered[-1][1] == out, (mod, covered)   # the whole fused weight


def test_every_linear_of_each_model_is_covered():
    for dialect, (family, naming, *_rest) in M.DIALECT_FILES.items():
        if naming == "xlabs":
            continue
        model, mods, _, _, stems = _file(dialect)
        hit = {t.module for t in D.resolve_all(stems, mods).values()}
        assert hit == set(M.linear_names(model)), dialect


@pytest.mark.parametrize("dialect", DIALECTS)
def test_dense_delta_through_the_resolver_equals_the_hand_computed_one(dialect):
    _, mods, tensors, expected, _ = _file(dialect, rank=3, seed=7)
    got = _dense_via_resolver(tensors, mods)
    assert set(got) == set(expected)
    for m in expected:
        torch.testing.assert_close(got[m], expected[m], rtol=0, atol=1e-12, msg=m)


def test_flux_slices_exactly():
    mods = dict(M.TinyFlux().named_modules())   # hidden 32, mlp 128
    r = lambda s: D.resolve(s, mods)
    assert r("transformer.transformer_blocks.1.attn.to_k") == D.Target("double_blocks.1.img_attn.qkv", (32, 64), "Flux diffusers")
    assert r("transformer.transformer_blocks.0.attn.add_v_proj").rows == (64, 96)
    assert r("transformer.transformer_blocks.0.attn.add_v_proj").module == "double_blocks.0.txt_attn.qkv"
    assert r("transformer.single_transformer_blocks.1.proj_mlp") == D.Target(
        "single_blocks.1.linear1", (96, 224), "Flux diffusers")
    assert r("lora_transformer_single_transformer_blocks_0_attn_to_v").rows == (64, 96)
    # kohya SD scripts on Flux: diffusers names, lora_unet_, a trailing '_'
    assert r("lora_unet_single_transformer_blocks_0_attn_to_k_") == D.Target(
        "single_blocks.0.linear1", (32, 64), "Flux kohya-diffusers (OneTrainer)")
    t = r("transformer.norm_out.linear")
    assert (t.module, t.rows, t.swap_halves) == ("final_layer.adaLN_modulation.1", None, True)
    assert r("transformer.single_transformer_blocks.0.proj_out").module == "single_blocks.0.linear2"
    assert r("transformer.proj_out").module == "final_layer.linear"
    # kohya's fused names: whole modules
    assert r("lora_unet_single_blocks_0_linear1") == D.Target("single_blocks.0.linear1", None, "Flux kohya")
    assert r("lora_unet_double_blocks_0_img_attn_qkv").rows is None
    # ComfyUI's own linear1_qkv key and XLabs/USO single-block qkv: linear1 rows [0, 3h)
    assert r("diffusion_model.single_blocks.0.linear1_qkv").rows == (0, 96)
    assert r("single_blocks.1.processor.qkv_lora") == D.Target("single_blocks.1.linear1", (0, 96), "Flux XLabs")
    # XLabs qkv_lora1 targets the WHOLE img_attn.qkv (diffusers would split it in three)
    assert r("double_blocks.0.processor.qkv_lora1") == D.Target("double_blocks.0.img_attn.qkv", None, "Flux XLabs")
    assert r("diffusion_model.double_blocks.1.processor.proj_lora2").module == "double_blocks.1.txt_attn.proj"
    # LyCORIS LoKr names and Flux 2 fused names
    assert r("lycoris_transformer_blocks_0_ff_linear_in").module == "double_blocks.0.img_mlp.0"
    assert r("transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj") == D.Target(
        "single_blocks.0.linear1", None, "Flux diffusers")


def test_norm_conv_and_parameter_targets():
    flux = dict(M.TinyFlux().named_modules())
    t = D.resolve("transformer.transformer_blocks.0.attn.norm_added_k", flux)
    assert t.module == "double_blocks.0.txt_attn.norm.key_norm" and isinstance(flux[t.module], nn.RMSNorm)
    assert D.resolve("transformer.single_transformer_blocks.1.attn.norm_q", flux).module == "single_blocks.1.norm.query_norm"
    assert D.resolve("diffusion_model.double_blocks.0.img_attn.norm.query_norm", flux).module == \
        "double_blocks.0.img_attn.norm.query_norm"

    wan = dict(M.TinyWan().named_modules())
    stem, part, _ = D.split_key("diffusion_model.blocks.0.modulation.diff")
    assert (stem, part) == ("diffusion_model.blocks.0.modulation", "diff")
    for key in ("diffusion_model.blocks.0.modulation.diff_m", "diffusion_model.blocks.0.norm3.w_norm",
                "diffusion_model.blocks.0.norm3.diff_b", "lora_unet_blocks_0_norm3.b_norm"):
        parts = D.split_key(key)
        assert parts is not None, key
        t = D.resolve(parts[0], wan)
        assert t is not None and t.module in ("blocks.0.modulation", "blocks.0.norm3"), key
    t = D.resolve(stem, wan)
    assert t == D.Target("blocks.0.modulation", None, "Wan native", param=True)
    assert D.resolve("diffusion_model.head.modulation", wan).param
    assert D.resolve("lora_unet_blocks_1_modulation", wan) == D.Target("blocks.1.modulation", None, "Wan kohya", param=True)
    assert D.resolve("transformer.blocks.1.scale_shift_table", wan) == D.Target(
        "blocks.1.modulation", None, "Wan diffusers", param=True)
    assert D.resolve("transformer.scale_shift_table", wan).module == "head.modulation"
    t = D.resolve("diffusion_model.blocks.0.norm3", wan)
    assert t.module == "blocks.0.norm3" and isinstance(wan[t.module], nn.LayerNorm) and not t.param
    assert isinstance(wan[D.resolve("diffusion_model.patch_embedding", wan).module], nn.Conv3d)
    assert D.resolve("diffusion_model.blocks.0.cross_attn.norm_k_img", wan).module == "blocks.0.cross_attn.norm_k_img"
    assert D.resolve("transformer.blocks.0.attn2.norm_added_k", wan).module == "blocks.0.cross_attn.norm_k_img"
    assert D.resolve("transformer.condition_embedder.image_embedder.norm2", wan).module == "img_emb.proj.4"

    ltx = dict(M.TinyLTXVideo().named_modules())
    assert D.resolve("diffusion_model.transformer_blocks.1.scale_shift_table", ltx).param
    assert D.resolve("diffusion_model.scale_shift_table", ltx) == D.Target("scale_shift_table", None, "LTX-Video native",
                                                                           param=True)
    assert D.resolve("transformer.transformer_blocks.0.attn2.norm_k", ltx).module == "transformer_blocks.0.attn2.k_norm"
    assert D.resolve("transformer.time_embed.linear", ltx).module == "adaln_single.linear"


def test_wan_diffusers_norm2_norm3_follow_the_file():
    wan = dict(M.TinyWan().named_modules())
    diffusers_file = ["transformer.blocks.0.attn1.to_q", "transformer.blocks.0.attn2.to_k", "transformer.blocks.0.ffn.net.2",
                      "transformer.blocks.0.norm2", "transformer.blocks.0.norm3"]
    got = D.resolve_all(diffusers_file, wan)
    assert got["transformer.blocks.0.norm2"].module == "blocks.0.norm3"    # diffusers norm2 = native norm3
    assert got["transformer.blocks.0.norm3"].module == "blocks.0.norm2"
    assert {t.dialect for t in got.values()} == {"Wan diffusers"}
    native_file = ["diffusion_model.blocks.0.self_attn.q", "diffusion_model.blocks.0.ffn.2", "diffusion_model.blocks.0.norm3"]
    got = D.resolve_all(native_file, wan)
    assert got["diffusion_model.blocks.0.norm3"].module == "blocks.0.norm3"
    assert D.resolve("diffusion_model.blocks.0.norm2", wan).module == "blocks.0.norm2"   # alone: literal first


def test_qwen_and_ltx_prefixes_name_the_dialect():
    q = dict(M.TinyQwenImage().named_modules())
    assert D.resolve("transformer_blocks.0.img_mlp.net.0.proj", q).dialect == "Qwen-Image diffusers"   # DiffSynth: bare
    assert D.resolve("base_model.model.transformer_blocks.0.txt_mod.1", q).dialect == "Qwen-Image diffusers"
    assert D.resolve("lora_unet_transformer_blocks_1_attn_add_k_proj", q).module == "transformer_blocks.1.attn.add_k_proj"
    assert D.resolve("lora_unet_transformer_blocks_0_attn_to_out_0", q).module == "transformer_blocks.0.attn.to_out.0"
    ltx = dict(M.TinyLTXVideo().named_modules())
    assert D.resolve("transformer_blocks.0.attn1.to_q", ltx).dialect == "LTX-Video native"          # ComfyUI: bare
    assert D.resolve("proj_in", ltx) == D.Target("patchify_proj", None, "LTX-Video diffusers")
    assert D.resolve("lora_unet_adaln_single_emb_timestep_embedder_linear_2", ltx).module == \
        "adaln_single.emb.timestep_embedder.linear_2"


def test_negatives():
    flux = dict(M.TinyFlux().named_modules())
    wan = dict(M.TinyWan().named_modules())
    qwen = dict(M.TinyQwenImage().named_modules())
    # a Flux stem on a Wan model, and the other way round
    for s in ("lora_unet_double_blocks_0_img_attn_qkv", "transformer.single_transformer_blocks.0.proj_mlp",
              "double_blocks.0.processor.qkv_lora1", "transformer.norm_out.linear"):
        assert D.resolve(s, wan) is None, s
    for s in ("diffusion_model.blocks.0.self_attn.q", "transformer.blocks.0.attn1.to_q", "lora_unet__blocks_0_ffn_0"):
        assert D.resolve(s, flux) is None, s
    # block index out of range, typos, a half-written name
    for s in ("diffusion_model.double_blocks.7.img_attn.qkv", "transformer.transformer_blocks.2.attn.to_q",
              "lora_unet_single_blocks_9_linear1", "diffusion_model.double_blocks.0.img_atn.qkv",
              "transformer.transformer_blocks.0.attn.to_qq", "double_blocks.0.processor.qkv_lora3",
              "transformer.transformer_blocks.0.attn", "lora_unet_double_blocks_0_img_attn_qkv_extra"):
        assert D.resolve(s, flux) is None, s
    # a container module is still a module: resolve names it, the caller refuses what is not a Linear
    t = D.resolve("lora_unet_double_blocks_0_img_attn", flux)
    assert t.module == "double_blocks.0.img_attn" and not isinstance(flux[t.module], nn.Linear)
    # a fused adapter for a model that holds the projection split: refused, not guessed
    for s in ("transformer.transformer_blocks.0.attn.to_qkv", "transformer.transformer_blocks.0.attn.to_added_qkv"):
        assert D.resolve(s, qwen) is None, s
    # Flux diffusers keys on Qwen-Image (shared attention names resolve, Flux-only names do not)
    assert D.resolve("transformer.transformer_blocks.0.ff.net.0.proj", qwen) is None
    assert D.resolve("transformer.single_transformer_blocks.0.attn.to_q", qwen) is None


def test_guess_family_and_dialect_name_for_other_models():
    assert D.guess_family is key_formats.guess_family
    assert D.guess_family(["lora_unet_double_blocks_0_img_attn_qkv"]) == "Flux"
    wan = dict(M.TinyWan().named_modules())
    stems = ["lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_0_linear1"]
    assert [D.resolve(s, wan) for s in stems] == [None, None]
    assert D.dialect_name(stems, wan) == "Flux kohya"        # named from the keys when none resolves
    assert D.dialect_name(["lora_unet_some_thing"]) == "kohya"
    assert D.dialect_name(["base_model.model.x.y"]) == "PEFT"
    assert D.dialect_name([]) == "unknown"
    # attention-only Flux diffusers keys read like Qwen-Image's too: Flux (table order) without a model
    attn_only = ["transformer.transformer_blocks.0.attn.to_q", "transformer.transformer_blocks.0.attn.add_k_proj"]
    assert D.dialect_name(attn_only) == "Flux diffusers"
    assert D.dialect_name(attn_only, dict(M.TinyQwenImage().named_modules())) == "Qwen-Image diffusers"
    # Flux keys on the engine tests' Wan-like model
    like = dict(TinyWanLike().named_modules())
    assert D.resolve("lora_unet_double_blocks_0_img_attn_qkv", like) is None
    assert D.resolve("transformer.single_transformer_blocks.0.attn.to_q", like) is None


def test_model_family():
    assert D.model_family(dict(M.TinyFlux().named_modules())) == "Flux"
    assert D.model_family(dict(M.TinyFlux2().named_modules())) == "Flux"
    assert D.model_family(dict(M.TinyFlux2(guidance=False).named_modules())) == "Flux"
    assert D.model_family(dict(M.TinyQwenImage().named_modules())) == "Qwen-Image"
    assert D.model_family(dict(M.TinyLTXVideo().named_modules())) == "LTX-Video"
    assert D.model_family(dict(M.TinyWan().named_modules())) == "Wan"
    assert D.model_family(dict(TinyWanLike().named_modules())) == "Wan"
    assert D.model_family(dict(nn.Sequential(nn.Linear(2, 2)).named_modules())) is None


def test_split_key_extras():
    assert D.split_key("double_blocks.0.processor.qkv_lora1.down.weight") == ("double_blocks.0.processor.qkv_lora1", "down", None)
    assert D.split_key("single_blocks.3.processor.proj_lora.up.weight") == ("single_blocks.3.processor.proj_lora", "up", None)
    assert D.split_key("transformer.x_embedder.lora_B.bias") == ("transformer.x_embedder", "diff_b", None)
    assert D.split_key("lora_unet_img_in.lora_down.weight") == ("lora_unet_img_in", "down", None)
    assert D.split_key("a.b.weight") is None


# --- Wan: every naming of every linear resolves to it -----------------------------------


def _variants(name):
    flat = name.replace(".", "_")
    return [name, "diffusion_model." + name, "model.diffusion_model." + name, "base_model.model." + name,
            "transformer." + name, "lora_unet_" + flat, "lora_unet__" + flat, "lora_transformer_" + flat,
            "lycoris_" + flat, flat, "transformer." + wan_native_to_diffusers(name),
            "base_model.model." + wan_native_to_diffusers(name), "model." + name]


@pytest.mark.parametrize("model_cls", [TinyWanLike, M.TinyWan])
def test_wan_every_naming_resolves(model_cls):
    mods = dict(model_cls().named_modules())
    for name in [n for n, m in mods.items() if isinstance(m, nn.Linear)]:
        for stem in _variants(name):
            t = D.resolve(stem, mods)
            assert t is not None and t.module == name and t.rows is None, (stem, t)


# diffusers' Wan names -> ComfyUI's (diffusers scripts/convert_wan_to_diffusers.py), written out here
WAN_RENAMES = [
    ("blocks.1.attn1.to_q", "blocks.1.self_attn.q"), ("blocks.1.attn1.to_k", "blocks.1.self_attn.k"),
    ("blocks.1.attn1.to_v", "blocks.1.self_attn.v"), ("blocks.1.attn1.to_out.0", "blocks.1.self_attn.o"),
    ("blocks.1.attn2.to_q", "blocks.1.cross_attn.q"), ("blocks.1.attn2.to_k", "blocks.1.cross_attn.k"),
    ("blocks.1.attn2.to_v", "blocks.1.cross_attn.v"), ("blocks.1.attn2.to_out.0", "blocks.1.cross_attn.o"),
    ("blocks.1.attn2.add_k_proj", "blocks.1.cross_attn.k_img"), ("blocks.1.attn2.add_v_proj", "blocks.1.cross_attn.v_img"),
    ("blocks.1.ffn.net.0.proj", "blocks.1.ffn.0"), ("blocks.1.ffn.net.2", "blocks.1.ffn.2"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("proj_out", "head.head"),
]


def test_wan_diffusers_renames():
    wan = dict(M.TinyWan().named_modules())
    for diffusers, native in WAN_RENAMES:
        assert native in wan, native
        t = D.resolve("transformer." + diffusers, wan)
        assert t is not None and t.module == native and t.dialect == "Wan diffusers", (diffusers, t)


def test_dialects_md_lists_every_dialect():
    text = (Path(D.__file__).parent / "DIALECTS.md").read_text()
    for d in D.DIALECTS:
        assert f"| {d.name} |" in text, d.name


def test_index_is_cached_per_mapping_and_rebuilt_for_another():
    model = M.TinyFlux()
    mods = dict(model.named_modules())
    a = D.resolve("transformer.transformer_blocks.0.attn.to_v", mods)
    assert D.resolve("transformer.transformer_blocks.0.attn.to_v", mods) == a
    # a new mapping with other shapes is indexed afresh
    small = dict(M.TinyFlux(hidden=16, heads=2).named_modules())
    assert D.resolve("transformer.transformer_blocks.0.attn.to_v", small).rows == (32, 48)


def test_lora_wrapped_modules_resolve_to_the_wrapper_and_no_model_is_kept_alive():
    import gc
    import weakref

    from comfyui_lora_runtime.lora_runtime.layer.wrapper import AdaptedLayer

    model = M.TinyFlux()
    blk = model.double_blocks[0].img_attn
    blk.qkv = AdaptedLayer(blk.qkv, "double_blocks.0.img_attn.qkv")
    mods = dict(model.named_modules())
    assert "double_blocks.0.img_attn.qkv.base_layer" in mods
    t = D.resolve("transformer.transformer_blocks.0.attn.to_v", mods)
    assert t == D.Target("double_blocks.0.img_attn.qkv", (64, 96), "Flux diffusers")
    assert D.resolve("diffusion_model.double_blocks.0.img_attn.qkv.base_layer", mods) is None
    ref = weakref.ref(model)
    del model, blk, mods, t
    gc.collect()
    assert ref() is None


def test_split_key_keeps_the_peft_slot_of_a_bias():
    assert D.split_key("transformer.x_embedder.lora_B.default_0.bias") == ("transformer.x_embedder", "diff_b", "default_0")
    assert D.split_key("transformer.x_embedder.lora_A.default_0.weight") == ("transformer.x_embedder", "down", "default_0")


def test_overlaps_names_the_pairs_that_collide():
    mods = dict(M.TinyFlux().named_modules())
    ts = D.resolve_all(["transformer.transformer_blocks.0.attn.to_q", "lora_unet_double_blocks_0_img_attn_qkv",
                        "transformer.transformer_blocks.0.attn.to_k"], mods)
    pairs = D.overlaps(ts.values())
    assert len(pairs) == 2 and all({a.module, b.module} == {"double_blocks.0.img_attn.qkv"} for a, b in pairs)


@pytest.mark.parametrize("family", sorted(M.MODELS))
def test_every_weighted_module_and_parameter_resolves_by_its_native_name(family):
    model = M.MODELS[family]()
    mods = dict(model.named_modules())
    names = [n for n, m in mods.items() if n and any(True for _ in m.parameters(recurse=False))]
    params = [n for n, _ in model.named_parameters() if not n.endswith((".weight", ".bias"))]
    label = "Flux" if family == "Flux 2" else family   # Flux 2 files are labelled as Flux's dialects
    assert names and (params or label in ("Flux", "Qwen-Image"))
    for n in names + params:
        for stem in ("diffusion_model." + n, "lora_unet_" + n.replace(".", "_")):
            t = D.resolve(stem, mods)
            assert t is not None and t.module == n and t.rows is None and not t.swap_halves, (stem, t)
            assert t.param == (n in params), stem
            assert t.dialect.startswith(label), (stem, t.dialect)


def test_quantized_style_weight_uses_the_linear_features():
    class Packed(nn.Module):   # a weight stored packed: storage shape is not [out, in]
        def __init__(self, lin):
            super().__init__()
            self.in_features, self.out_features = lin.in_features, lin.out_features
            self.weight = nn.Parameter(torch.zeros(lin.out_features * lin.in_features // 2, 1), requires_grad=False)

    model = M.TinyFlux()
    model.single_blocks[0].linear1 = Packed(model.single_blocks[0].linear1)
    mods = dict(model.named_modules())
    assert D.resolve("transformer.single_transformer_blocks.0.proj_mlp", mods).rows == (96, 224)


def test_save_dialect_file_round_trips(tmp_path):
    from safetensors.torch import load_file

    model = M.TinyFlux()
    expected = M.save_dialect_file(tmp_path / "xlabs.safetensors", "Flux XLabs", model, rank=2, seed=3)
    tensors = load_file(str(tmp_path / "xlabs.safetensors"))
    got = _dense_via_resolver(tensors, dict(model.named_modules()))
    assert set(got) == set(expected)
    for m in expected:
        torch.testing.assert_close(got[m], expected[m], rtol=0, atol=1e-12)
