"""Z-Image (ComfyUI's Lumina2 class), HunyuanVideo 1.0 / 1.5 and Chroma: every key dialect ComfyUI's
loader accepts for them, and the ones it does not (musubi-tuner's HunyuanVideo names, Chroma's
approximator in diffusers names), on tiny skeletons with the real module names
(`testkit.dialect_models.MORE_MODELS`).

- the resolver: every stem lands on the hand-written module and rows (Z-Image's q/k/v = row thirds
  of ``attention.qkv``), labelled with its dialect; the whole model covered once, no overlap;
- the loader and the wrapper, dynamic and merged (in `test_dialect_files_applied`, with the other
  families): each native module receives exactly the delta computed by hand;
- the host's key map (`files.host_keys`) on a hand-written ComfyUI-style map: its targets win over
  the tables (rows, swapped halves, parameters), entries the pack cannot honour are left to the
  tables with the reason, a host that fails leaves the tables in charge;
- the family follows the host's class when it gives one, not the module names;
- the loading policy: a file mostly for this model loads what maps and lists the rest ('skip and
  report'), or stops naming the keys ('error'); a file for another model is refused either way.
"""
from __future__ import annotations

import functools
import logging

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import load_adapter, match_adapter
from comfyui_lora_runtime.lora_runtime.errors import AdapterMatchError
from comfyui_lora_runtime.lora_runtime.files import dialects as D
from comfyui_lora_runtime.lora_runtime.files import host_keys

from testkit import dialect_models as M

DIALECTS = sorted(M.MORE_DIALECT_FILES)


@functools.lru_cache(maxsize=None)
def _file(dialect, rank=4, seed=0):
    family = M.MORE_DIALECT_FILES[dialect][0]
    model = M.ALL_MODELS[family]()
    tensors, expected = M.make_dialect_file(dialect, model, rank, seed)
    stems = sorted({D.split_key(k)[0] for k in tensors})
    return model, dict(model.named_modules()), tensors, expected, stems


@pytest.fixture
def no_host():
    """No host key map during the test (and none left behind)."""
    host_keys.set_provider(None)
    yield
    host_keys.set_provider(None)


# --- the resolver -----------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_stem_resolves_to_the_hand_written_target(dialect):
    model, mods, _, _, stems = _file(dialect)
    label = M.MORE_DIALECT_FILES[dialect][4]
    want = {s: (n, r, sw) for s, n, r, sw in M.dialect_layers(dialect, model)}
    got = D.resolve_all(stems, mods)
    assert set(got) == set(want)
    assert not [s for s, t in got.items() if t is None]
    for s, t in got.items():
        assert (t.module, t.rows, t.swap_halves) == want[s], s
        assert not t.param and t.dialect == label, (s, t.dialect)
        alone = D.resolve(s, mods)                       # without the file: the same place
        assert (alone.module, alone.rows, alone.swap_halves) == want[s], s
        if dialect not in M.FILE_CONTEXT_LABELS:         # names both namings share take the prefix's label
            assert alone == t, s


@pytest.mark.parametrize("dialect", DIALECTS)
def test_dialect_name(dialect):
    _, mods, _, _, stems = _file(dialect)
    label = M.MORE_DIALECT_FILES[dialect][4]
    assert D.dialect_name(stems, mods) == label
    assert D.dialect_name(stems) == label                # from the names alone
    assert label in {d.name for d in D.DIALECTS}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_every_linear_is_covered_once(dialect):
    model, mods, _, _, stems = _file(dialect)
    targets = list(D.resolve_all(stems, mods).values())
    assert {t.module for t in targets} == set(M.linear_names(model))
    assert D.overlaps(targets) == []
    rows: dict[str, list] = {}
    for t in targets:
        rows.setdefault(t.module, []).append(t.rows)
    for mod, rs in rows.items():
        if rs == [None]:
            continue
        covered = sorted(rs)
        assert covered[0][0] == 0 and covered[-1][1] == mods[mod].weight.shape[0], (mod, covered)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (mod, covered)


def test_z_image_qkv_thirds_are_the_models_dim_rows():
    model = M.TinyZImage(d=48, heads=3)
    mods = dict(model.named_modules())
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        for prefix in ("transformer.", "diffusion_model.", "", "lycoris_"):
            stem = f"{prefix}noise_refiner.1.attention.{part}"
            stem = stem if not prefix.endswith("_") else prefix + stem[len(prefix):].replace(".", "_")
            t = D.resolve(stem, mods)
            assert (t.module, t.rows) == ("noise_refiner.1.attention.qkv", (48 * i, 48 * (i + 1))), stem
    # a grouped-query qkv (out != 3 * dim) has no thirds: refused, not guessed
    gqa = M.TinyZImage(d=48, heads=3)
    gqa.layers[0].attention.qkv = torch.nn.Linear(48, 80, bias=False)
    assert D.resolve("transformer.layers.0.attention.to_q", dict(gqa.named_modules())) is None


# --- loaded and applied ----------------------------------------------------------------


def test_sliced_z_image_file_differs_from_reading_to_q_as_the_whole_qkv():
    model, _, _, expected, _ = _file("Z-Image diffusers")
    want = expected["layers.0.attention.qkv"]
    only_q = torch.zeros_like(want)
    only_q[:32] = want[:32]
    assert ((want - only_q).norm() / want.norm()).item() > 0.5


# --- the files the issue names: refused before, loaded now ------------------------------


@pytest.mark.parametrize("dialect,looks", [
    ("Z-Image diffusers (diffusion_model.)", "Z-Image"), ("Z-Image diffusers", "Z-Image"),
    ("Z-Image LyCORIS", "Z-Image"), ("HunyuanVideo 1.5 diffusion-pipe", "HunyuanVideo"),
    ("HunyuanVideo diffusion-pipe", "HunyuanVideo")])
def test_files_of_these_families_load_whole_and_are_named_for_their_family(tmp_path, dialect, looks, no_host):
    model, _, tensors, expected, stems = _file(dialect)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "f.safetensors"))
    layers, cov = match_adapter(load_adapter(tmp_path / "f.safetensors"), model)   # strict: every key placed
    assert set(layers) == set(expected) and cov.applied_layers == cov.file_layers == len(stems)
    assert D.guess_family(stems) == looks
    # on another model it is refused, naming the family its keys look like
    with pytest.raises(AdapterMatchError, match=f"look like an adapter for {looks}"):
        match_adapter(load_adapter(tmp_path / "f.safetensors"), M.TinyWan(), lenient=True)


def test_hunyuan_video_keys_on_flux_and_flux_keys_on_hunyuan_video(tmp_path, no_host):
    """The two share Flux's blocks in ComfyUI: native names fit both, diffusion-pipe names only
    HunyuanVideo, diffusers names only Flux."""
    hv, flux = M.TinyHunyuanVideo(), M.TinyFlux()
    assert D.model_family(dict(hv.named_modules())) == "HunyuanVideo"
    assert D.model_family(dict(flux.named_modules())) == "Flux"
    assert D.resolve("transformer.double_blocks.0.img_attn_qkv", dict(flux.named_modules())) is None
    assert D.resolve("transformer.transformer_blocks.0.attn.to_q", dict(hv.named_modules())) is None
    t = D.resolve("transformer.double_blocks.1.txt_mlp.fc2", dict(hv.named_modules()))
    assert t.module == "double_blocks.1.txt_mlp.2" and t.dialect == "HunyuanVideo diffusion-pipe"


# --- the family is the host's class when the host names one ------------------------------


def test_family_follows_the_hosts_class_not_the_module_names():
    flux_like = dict(M.TinyFlux().named_modules())       # Flux's blocks; ComfyUI says HunyuanVideo
    stem = "transformer.double_blocks.0.img_mod.linear"
    assert D.resolve(stem, flux_like) is None
    assert D.resolve(stem, flux_like, family="HunyuanVideo").module == "double_blocks.0.img_mod.lin"
    hv = dict(M.TinyHunyuanVideo().named_modules())
    assert D.resolve("transformer.double_blocks.0.img_attn_qkv", hv).module == "double_blocks.0.img_attn.qkv"
    # a class none of the tables is for (''): only the model's own names
    assert D.resolve("transformer.double_blocks.0.img_attn_qkv", hv, family="") is None
    assert D.resolve("diffusion_model.double_blocks.0.img_attn.qkv", hv, family="").module == \
        "double_blocks.0.img_attn.qkv"
    z = dict(M.TinyZImage().named_modules())
    assert D.resolve("transformer.layers.0.attention.to_out.0", z, family="Z-Image").module == "layers.0.attention.out"
    assert D.resolve("transformer.layers.0.attention.to_out.0", z, family="") is None


# --- the host's key map -----------------------------------------------------------------


def _swap(w):   # stands for ComfyUI's swap_scale_shift (identity-compared, never called)
    raise AssertionError("not called")


def _other(w):
    raise AssertionError("not called")


def _z_host_map(model, **kw):
    """A ComfyUI-style key map for TinyZImage written by hand: native names, a few diffusers names
    (one deliberately elsewhere than the tables put it), a swap, and entries the pack cannot use."""
    d = model.dim
    km = {}
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            km[f"diffusion_model.{n}"] = f"diffusion_model.{n}.weight"
            km[f"lora_unet_{n.replace('.', '_')}"] = f"diffusion_model.{n}.weight"
    for i, q in enumerate(("to_q", "to_k", "to_v")):
        km[f"transformer.layers.0.attention.{q}"] = ("diffusion_model.layers.0.attention.qkv.weight", (0, i * d, d))
    km["transformer.layers.0.feed_forward.w1"] = "diffusion_model.layers.0.feed_forward.w3.weight"  # host's word
    km["custom.final_adaln"] = ("diffusion_model.final_layer.adaLN_modulation.1.weight", None, _swap)
    km["custom.narrow_cols"] = ("diffusion_model.layers.1.feed_forward.w1.weight", (1, 0, 8))
    km["custom.unknown_fn"] = ("diffusion_model.layers.1.feed_forward.w2.weight", None, _other)
    km["custom.absent"] = "diffusion_model.layers.9.feed_forward.w1.weight"
    km["diffusion_model.x_pad_token"] = "diffusion_model.x_pad_token"
    km["text_encoders.something"] = "clip_l.transformer.weight"   # not the diffusion model: ignored
    return host_keys.from_key_map(km, host="ComfyUI", model_class="ZImage", base_class="Lumina2", family="Z-Image",
                                  swap_functions=[_swap], source="hand-written", **kw)


@pytest.fixture
def host_map():
    model = M.TinyZImage()
    hmap = _z_host_map(model)
    host_keys.set_provider(lambda m: hmap if m is model else None)
    yield model, hmap
    host_keys.set_provider(None)


def _lora(tmp_path, model, stems_to_native: dict, name="h.safetensors", extra=None):
    g = torch.Generator().manual_seed(3)
    mods = dict(model.named_modules())
    sd, want = {}, {}
    for stem, (native, rows, swap) in stems_to_native.items():
        out_f, in_f = mods[native].weight.shape
        lo, hi = rows or (0, out_f)
        down, up = torch.randn(2, in_f, generator=g) * 0.1, torch.randn(hi - lo, 2, generator=g) * 0.1
        sd[f"{stem}.lora_A.weight"], sd[f"{stem}.lora_B.weight"] = down, up
        d = up.double() @ down.double()
        if swap:
            d = torch.cat([d[d.shape[0] // 2:], d[: d.shape[0] // 2]])
        want.setdefault(native, torch.zeros(out_f, in_f, dtype=torch.float64))[lo:hi] += d
    sd.update(extra or {})
    save_file(sd, str(tmp_path / name))
    return load_adapter(tmp_path / name), want


def test_host_map_entries(host_map):
    model, hmap = host_map
    e = hmap.entries
    assert e["transformer.layers.0.attention.to_k"] == host_keys.HostTarget("layers.0.attention.qkv", (32, 64))
    assert e["custom.final_adaln"].swap_halves and e["custom.final_adaln"].rows is None
    assert e["diffusion_model.x_pad_token"] == host_keys.HostTarget("x_pad_token", None, False, False)
    assert "dim 0" in hmap.skipped["custom.narrow_cols"] and "does not know" in hmap.skipped["custom.unknown_fn"]
    assert "text_encoders.something" not in e and hmap.who == "ComfyUI's key map for ZImage (Lumina2)"


def test_the_hosts_targets_win_and_the_tables_place_the_rest(tmp_path, host_map, caplog):
    model, hmap = host_map
    adapter, want = _lora(tmp_path, model, {
        "transformer.layers.0.attention.to_q": ("layers.0.attention.qkv", (0, 32), False),
        "transformer.layers.0.attention.to_v": ("layers.0.attention.qkv", (64, 96), False),
        "transformer.layers.0.feed_forward.w1": ("layers.0.feed_forward.w3", None, False),  # host: w3, tables: w1
        "custom.final_adaln": ("final_layer.adaLN_modulation.1", None, True),
        "transformer.layers.1.attention.to_out.0": ("layers.1.attention.out", None, False),  # tables only
        "all_x_embedder.2-1": ("x_embedder", None, False),                                   # tables only
    })
    with caplog.at_level(logging.INFO):
        layers, cov = match_adapter(adapter, model)
    assert cov.unmatched == {} and set(layers) == set(want)
    for name, w in want.items():
        got = layers[name].update.delta().double()
        assert ((got - w).norm() / w.norm()).item() <= 1e-6, name
    assert "4 of the file's 6 layers placed by ComfyUI's key map for ZImage (Lumina2) (hand-written)" in cov.notes
    assert any(n.startswith("2 layers placed by the pack's own key tables, which ComfyUI's own loader does not "
                            "load") for n in cov.notes), cov.notes
    assert "transformer.layers.0.feed_forward.w1 -> layers.0.feed_forward.w3 (tables: layers.0.feed_forward.w1)" \
        in caplog.text


def test_host_entries_the_pack_cannot_use_give_their_reason(tmp_path, host_map):
    model, _ = host_map
    adapter, _ = _lora(tmp_path, model, {
        "transformer.layers.0.attention.to_q": ("layers.0.attention.qkv", (0, 32), False),
        "transformer.layers.0.attention.to_k": ("layers.0.attention.qkv", (32, 64), False),
        "transformer.layers.0.attention.to_v": ("layers.0.attention.qkv", (64, 96), False),
        "custom.narrow_cols": ("layers.1.feed_forward.w1", None, False),
        "custom.unknown_fn": ("layers.1.feed_forward.w2", None, False),
        "custom.absent": ("layers.1.feed_forward.w3", None, False),
    })
    with pytest.raises(AdapterMatchError, match="would not be applied"):
        match_adapter(adapter, model)
    _, cov = match_adapter(adapter, model, lenient=True)
    assert "only output-row slices (dim 0)" in cov.unmatched["custom.narrow_cols"]
    assert "which this pack does not know" in cov.unmatched["custom.unknown_fn"]
    assert cov.unmatched["custom.absent"] == ("ComfyUI's key map for ZImage (Lumina2) sends it to "
                                              "layers.9.feed_forward.w1.weight, which this model does not have")


def test_host_parameter_target(tmp_path, host_map):
    model, _ = host_map
    sd = {"diffusion_model.x_pad_token.diff": torch.full((1, 32), 0.25),
          "diffusion_model.layers.0.feed_forward.w2.lora_A.weight": torch.randn(2, 64),
          "diffusion_model.layers.0.feed_forward.w2.lora_B.weight": torch.randn(32, 2)}
    save_file(sd, str(tmp_path / "p.safetensors"))
    layers, cov = match_adapter(load_adapter(tmp_path / "p.safetensors"), model)
    assert cov.unmatched == {} and "x_pad_token" in layers and "layers.0.feed_forward.w2" in layers


def test_host_conversion_renames_before_the_map_is_read(tmp_path):
    model = M.TinyZImage()

    def convert(sd):   # a host conversion: "my_" keys are the host's "transformer." keys
        return {("transformer." + k[3:] if k.startswith("my_") else k): v for k, v in sd.items()}

    hmap = _z_host_map(model, convert=convert)
    host_keys.set_provider(lambda m: hmap)
    try:
        adapter, want = _lora(tmp_path, model, {
            "my_layers.0.attention.to_k": ("layers.0.attention.qkv", (32, 64), False),
            "my_layers.0.feed_forward.w1": ("layers.0.feed_forward.w3", None, False)})
        layers, cov = match_adapter(adapter, model)
    finally:
        host_keys.set_provider(None)
    assert cov.unmatched == {} and set(layers) == set(want)
    assert host_keys.converted_stems(adapter, convert)["my_layers.0.attention.to_k"] == \
        "transformer.layers.0.attention.to_k"


def test_a_host_that_fails_leaves_the_tables_in_charge(tmp_path, caplog):
    model = M.TinyZImage()

    def broken(m):
        raise RuntimeError("state_dict exploded")

    host_keys.set_provider(broken)
    try:
        tensors, expected = M.make_dialect_file("Z-Image diffusers", model)
        save_file(tensors, str(tmp_path / "z.safetensors"))
        with caplog.at_level(logging.WARNING):
            layers, cov = match_adapter(load_adapter(tmp_path / "z.safetensors"), model)
    finally:
        host_keys.set_provider(None)
    assert set(layers) == set(expected) and cov.unmatched == {}
    assert "the host's key map could not be read (RuntimeError: state_dict exploded)" in caplog.text


# --- the loading policy -----------------------------------------------------------------


def _flux_diffusers_file_on_chroma(tmp_path):
    """A Flux.1 diffusers file (every Linear of a Flux) for a Chroma: Chroma has Flux's attention and
    MLPs but no per-block modulation, no time/vector/guidance embedders, no final adaLN."""
    tensors, _ = M.make_dialect_file("Flux diffusers", M.TinyFlux(), rank=4, seed=5)
    save_file(tensors, str(tmp_path / "flux_on_chroma.safetensors"))
    return load_adapter(tmp_path / "flux_on_chroma.safetensors")


def test_chroma_policy_a_flux_file_applies_what_maps_and_reports_the_rest(tmp_path, no_host):
    chroma = M.TinyChroma()
    adapter = _flux_diffusers_file_on_chroma(tmp_path)
    with pytest.raises(AdapterMatchError, match="would not be applied"):   # 'error': nothing dropped silently
        match_adapter(adapter, chroma)
    layers, cov = match_adapter(adapter, chroma, lenient=True)             # 'skip and report'
    assert cov.applied_layers == 37 and cov.file_layers == 50               # attention, MLPs, img_in, txt_in, ...
    assert all(v == "no such layer in the model" for v in cov.unmatched.values())
    assert "transformer.transformer_blocks.0.norm1.linear" in cov.unmatched
    assert not any(n.startswith("distilled_guidance_layer") for n in layers)


def test_chroma_policy_on_the_node(tmp_path, no_host):
    """Load LoRA Adapter: 'skip and report' applies what maps and lists the rest; 'error' stops on the
    first key without a layer; a file for another model is refused either way."""
    from comfyui_lora_runtime.standalone.host import folder_paths
    from comfyui_lora_runtime.standalone.host.model_patcher import BundledModel, BundledModelPatcher
    from comfyui_lora_runtime.nodes.lora_nodes import LoadLoraAdapter
    from comfyui_lora_runtime.lora_runtime import LoraRuntimeError

    (tmp_path / "loras").mkdir()
    _flux_diffusers_file_on_chroma(tmp_path / "loras")
    tensors, _ = M.make_dialect_file("Wan native", M.TinyWan())
    save_file(tensors, str(tmp_path / "loras" / "wan.safetensors"))
    patcher = BundledModelPatcher(BundledModel(M.TinyChroma()))
    with folder_paths.activated(folder_paths.ModelFolders(models_dir=tmp_path, output_dir=tmp_path / "out")):
        out = LoadLoraAdapter().load(patcher, "flux_on_chroma.safetensors", 1.0, unmatched_keys="skip and report")
        cov = out["ui"]["lora_coverage"][0]
        assert (cov["matched"], cov["file_layers"], cov["unmatched"]) == (37, 50, 13)
        assert any("norm1.linear" in e for e in cov["unmatched_examples"])
        with pytest.raises(LoraRuntimeError, match="would not be applied"):
            LoadLoraAdapter().load(patcher, "flux_on_chroma.safetensors", 1.0, unmatched_keys="error")
        for choice in ("skip and report", "error"):
            with pytest.raises(LoraRuntimeError, match="look like an adapter for Wan"):
                LoadLoraAdapter().load(patcher, "wan.safetensors", 1.0, unmatched_keys=choice)


def test_chroma_approximator_in_diffusers_names_loads_in_strict_mode(tmp_path, no_host):
    """diffusers / OneTrainer Chroma files train the approximator (distilled_guidance_layer.layers.N.
    linear_1/2): ComfyUI's key map has no name for it (its loader drops it with warnings); the tables
    place it, so the whole file loads with 'error' too."""
    for dialect in ("Chroma diffusers", "Chroma kohya-diffusers (OneTrainer)"):
        model, _, tensors, expected, stems = _file(dialect)
        save_file(tensors, str(tmp_path / "c.safetensors"))
        layers, cov = match_adapter(load_adapter(tmp_path / "c.safetensors"), model)
        assert cov.unmatched == {} and cov.applied_layers == len(stems)
        assert {n for n in layers if n.startswith("distilled_guidance_layer")} == {
            "distilled_guidance_layer.in_proj", "distilled_guidance_layer.out_proj",
            "distilled_guidance_layer.layers.0.in_layer", "distilled_guidance_layer.layers.0.out_layer",
            "distilled_guidance_layer.layers.1.in_layer", "distilled_guidance_layer.layers.1.out_layer"}
