"""Adapter files the integration tests write: the reference tiny Wan's 20 Linear layers,
kohya keys, a fixed generator per seed (same seed -> same tensors in every test file)."""
import math
import shutil

import torch
from safetensors.torch import save_file

DIM, FFN, BLOCKS = 128, 512, 2  # the reference tiny Wan (tests/data/comfyui-0.3.64)
MODEL = "tiny_wan_d128_l2.safetensors"
LATENT_TAG = "ZZLoraRuntimeTestLatentTag"


def sampling_graph(cond_class: str, tag: str) -> dict:
    """The API-prompt nodes every sampling test starts from: the reference tiny Wan (node 1),
    positive / zero conditioning (2, 3) from the test node pack's `cond_class`, a 64x64
    one-frame latent (4) and its tag node (40)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
        "2": {"class_type": cond_class, "inputs": {"which": "positive"}},
        "3": {"class_type": cond_class, "inputs": {"which": "zeros"}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}},
        "40": {"class_type": LATENT_TAG, "inputs": {"samples": ["4", 0], "tag": tag}},
    }


class PromptGraph:
    """An API prompt on `sampling_graph`: KSamplers that save their latent under ``it_<folder>/``,
    ComfyUI's LoraLoaderModelOnly, and our chain (load -> merge mode -> tier -> report). `saves`
    and `reports` map a sampler's id to its SaveLatent / report node."""

    def __init__(self, cond_class: str, folder: str, tag, settings: dict, strength: float):
        self.folder, self.tag, self.settings, self.strength = folder, tag, settings, strength
        self.p = sampling_graph(cond_class, f"{folder}-{tag}")
        self.saves: dict[str, str] = {}
        self.reports: dict[str, str] = {}

    def node(self, nid, class_type, **inputs) -> list:
        assert nid not in self.p, nid
        self.p[nid] = {"class_type": class_type, "inputs": inputs}
        return [nid, 0]

    def ksampler(self, nid, model):
        self.node(nid, "KSampler", model=model, positive=["2", 0], negative=["3", 0], latent_image=["40", 0],
                  denoise=1.0, **self.settings)
        self.node(f"s{nid}", "SaveLatent", samples=[nid, 0], filename_prefix=f"it_{self.folder}/{nid}_{self.tag}")
        self.saves[nid] = f"s{nid}"

    def run(self, comfy, *, require_ran: bool = False) -> tuple[dict, dict]:
        """Queue the prompt on `comfy`: ({sampler id: its saved latent}, {sampler id: its report});
        `require_ran`: every sampler executed, none came from the cache."""
        from safetensors.torch import load as load_safetensors_bytes
        record = comfy.run(self.p)
        outputs = record["history"]["outputs"]
        lat, reps = {}, {}
        for nid, save in self.saves.items():
            if require_ran:
                assert nid in record["executing"] and nid not in record["cached"], f"sampler {nid} did not run"
            (item,) = outputs[save]["latents"]
            raw = comfy.fetch_view(item["filename"], item.get("subfolder", ""), item.get("type", "output"))
            lat[nid] = load_safetensors_bytes(raw)["latent_tensor"]
        for nid, r in self.reports.items():
            (reps[nid],) = outputs[r]["lora_report"]
        return lat, reps

    def comfy_lora(self, nid, name):
        m = self.node(f"L{nid}", "LoraLoaderModelOnly", model=["1", 0], lora_name=name, strength_model=self.strength)
        self.ksampler(nid, m)

    def ours(self, nid, name, mode, tier="exact"):
        m = self.node(f"A{nid}", "LoraRuntimeLoadAdapter", model=["1", 0], lora_name=name, strength=self.strength)
        m = self.node(f"M{nid}", "LoraRuntimeMergeMode", model=m, mode=mode)
        m = self.node(f"Q{nid}", "LoraRuntimeQualityTier", model=m, tier=tier)
        self.ksampler(nid, m)
        self.node(f"R{nid}", "LoraRuntimeReport", model=m, latent=[nid, 0])
        self.reports[nid] = f"R{nid}"


def psnr(a: torch.Tensor, ref: torch.Tensor) -> float:
    """dB against ``ref``, peak = ``ref``'s value range; inf when equal."""
    a, ref = a.double(), ref.double()
    mse = float(((a - ref) ** 2).mean())
    if mse == 0.0:
        return math.inf
    peak = float(ref.max() - ref.min())
    return 10.0 * math.log10(peak * peak / mse)

def _wan_modules():
    for b in range(BLOCKS):
        for attn in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o"):
                yield f"blocks.{b}.{attn}.{p}", DIM, DIM
        yield f"blocks.{b}.ffn.0", DIM, FFN
        yield f"blocks.{b}.ffn.2", FFN, DIM


def write_kohya_lora(path, *, seed, rank, alpha, up_scale=0.5, dtype=torch.float32, modules=None):
    """kohya/ComfyUI keys: diffusion_model.<module>.lora_down.weight [r,in], .lora_up.weight
    [out,r], .alpha. Sized so that the update is about half the weight's own scale."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, fan_in, fan_out in (modules or _wan_modules()):
        down = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
        up = torch.randn(fan_out, rank, generator=g) * (up_scale * math.sqrt(rank) / alpha)  # var(dW) = up_scale^2/in
        sd[f"diffusion_model.{name}.lora_down.weight"] = down.to(dtype)
        sd[f"diffusion_model.{name}.lora_up.weight"] = up.to(dtype)
        sd[f"diffusion_model.{name}.alpha"] = torch.tensor(float(alpha))
    save_adapter_file(sd, path)


def save_adapter_file(sd, path, *, header_low_byte_0x80=False):
    """save_file, padding the metadata so that the header length's low byte is (or is not)
    0x80: lora_runtime's pickle sniffing refuses valid files whose first byte is 0x80
    (see test_safetensors_file_whose_first_byte_is_0x80_loads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for pad in range(512):
        save_file(sd, str(path), metadata={"written_by": "comfyui-lora-runtime integration tests",
                                            "pad": "x" * pad})
        if (path.read_bytes()[0] == 0x80) == header_low_byte_0x80:
            return
    raise AssertionError("could not steer the safetensors header length")


# ---------------------------------------------------------------------------
# adapter variants (test_variants_real.py): LoHa, LoKr, full diffs, norm/parameter
# deltas, a conv LoRA and DoRA, in ComfyUI-native keys (diffusion_model.<module>.<part>)
# ---------------------------------------------------------------------------
VARIANT_KINDS = ("loha", "loha_cp", "lokr_w1_w2ab", "lokr_w1ab_w2", "lokr_tucker", "full_diff", "lora_diff_b",
                 "lightx2v", "lightx2v_diff_m", "conv_patch_embedding", "dora_out", "dora_in")


def _kron_split(n):
    """(p, q) with p * q == n for a LoKr side: 4 for 128, 8 for 512."""
    p = 4 if n == DIM else 8
    return p, n // p


def _target_std(fan_in):
    return 0.5 / math.sqrt(fan_in)  # the update is about half the weight's own scale (as write_kohya_lora)


def _rescale(delta, fan_in):
    return _target_std(fan_in) / float(delta.std())


def load_base_weights(model_path):
    """The reference model's tensors as fp32 (its own names, no diffusion_model. prefix)."""
    from safetensors.torch import load_file
    return {k: v.float() for k, v in load_file(str(model_path)).items()}


def _lora_factors(g, fan_in, fan_out, rank, alpha, up_scale=0.5):
    down = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
    up = torch.randn(fan_out, rank, generator=g) * (up_scale * math.sqrt(rank) / alpha)
    return down, up


def write_variant_file(path, kind, *, seed, model_path=None):
    """One adapter file of `kind` (VARIANT_KINDS) on the tiny Wan; returns the state dict
    written (fp32). `model_path` (the reference model) is needed for the DoRA kinds: their
    magnitude is the merged weight's norm times (1 + 0.2 N(0, 1)), clamped to >= 0.5."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    P = "diffusion_model."
    mods = list(_wan_modules())
    if kind in ("loha", "loha_cp"):
        r, alpha = 4, 2.0
        for name, fi, fo in mods:
            if kind == "loha":
                w1a, w1b = torch.randn(fo, r, generator=g), torch.randn(r, fi, generator=g)
                w2a, w2b = torch.randn(fo, r, generator=g), torch.randn(r, fi, generator=g)
                d = (w1a @ w1b) * (w2a @ w2b) * (alpha / r)
            else:  # CP: w_a [r, out], t [r, r, 1, 1], w_b [r, in]; factor = w_a^T t w_b
                w1a, w1b = torch.randn(r, fo, generator=g), torch.randn(r, fi, generator=g)
                w2a, w2b = torch.randn(r, fo, generator=g), torch.randn(r, fi, generator=g)
                t1, t2 = torch.randn(r, r, 1, 1, generator=g), torch.randn(r, r, 1, 1, generator=g)
                d = (w1a.t() @ t1[:, :, 0, 0] @ w1b) * (w2a.t() @ t2[:, :, 0, 0] @ w2b) * (alpha / r)
                sd[f"{P}{name}.hada_t1"], sd[f"{P}{name}.hada_t2"] = t1, t2
            w1a = w1a * _rescale(d, fi)  # the update is linear in w1_a
            sd.update({f"{P}{name}.hada_w1_a": w1a, f"{P}{name}.hada_w1_b": w1b, f"{P}{name}.hada_w2_a": w2a,
                       f"{P}{name}.hada_w2_b": w2b, f"{P}{name}.alpha": torch.tensor(alpha)})
    elif kind in ("lokr_w1_w2ab", "lokr_w1ab_w2", "lokr_tucker"):
        r, alpha = 4, 2.0
        for name, fi, fo in mods:
            (a, c), (b, dd) = _kron_split(fo), _kron_split(fi)
            if kind == "lokr_w1_w2ab":
                w1 = torch.randn(a, b, generator=g)
                w2a, w2b = torch.randn(c, r, generator=g), torch.randn(r, dd, generator=g)
                w2, scale = w2a @ w2b, alpha / r
                w1 = w1 * _rescale(torch.kron(w1, w2) * scale, fi)
                sd.update({f"{P}{name}.lokr_w1": w1, f"{P}{name}.lokr_w2_a": w2a, f"{P}{name}.lokr_w2_b": w2b})
            elif kind == "lokr_w1ab_w2":
                r1 = 2
                w1a, w1b = torch.randn(a, r1, generator=g), torch.randn(r1, b, generator=g)
                w2, scale = torch.randn(c, dd, generator=g), alpha / r1
                w1a = w1a * _rescale(torch.kron(w1a @ w1b, w2) * scale, fi)
                sd.update({f"{P}{name}.lokr_w1_a": w1a, f"{P}{name}.lokr_w1_b": w1b, f"{P}{name}.lokr_w2": w2})
            else:  # Tucker: w2 = w2_a^T t2 w2_b with w2_a [r, c], t2 [r, r, 1, 1], w2_b [r, d]
                w1 = torch.randn(a, b, generator=g)
                w2a, w2b = torch.randn(r, c, generator=g), torch.randn(r, dd, generator=g)
                t2 = torch.randn(r, r, 1, 1, generator=g)
                w2, scale = w2a.t() @ t2[:, :, 0, 0] @ w2b, alpha / r
                w1 = w1 * _rescale(torch.kron(w1, w2) * scale, fi)
                sd.update({f"{P}{name}.lokr_w1": w1, f"{P}{name}.lokr_w2_a": w2a, f"{P}{name}.lokr_w2_b": w2b,
                           f"{P}{name}.lokr_t2": t2})
            sd[f"{P}{name}.alpha"] = torch.tensor(alpha)
    elif kind == "full_diff":
        for name, fi, fo in mods:
            sd[f"{P}{name}.diff"] = torch.randn(fo, fi, generator=g) * _target_std(fi)
            sd[f"{P}{name}.diff_b"] = torch.randn(fo, generator=g) * 0.05
    elif kind in ("lora_diff_b", "lightx2v", "lightx2v_diff_m"):
        r, alpha = 4, 4.0
        for name, fi, fo in mods:
            down, up = _lora_factors(g, fi, fo, r, alpha)
            sd.update({f"{P}{name}.lora_down.weight": down, f"{P}{name}.lora_up.weight": up,
                       f"{P}{name}.alpha": torch.tensor(alpha)})
            if kind == "lora_diff_b":
                sd[f"{P}{name}.diff_b"] = torch.randn(fo, generator=g) * 0.05
        if kind != "lora_diff_b":
            m = "diff" if kind == "lightx2v" else "diff_m"
            for b in range(BLOCKS):
                if kind == "lightx2v":  # norm deltas as .diff / .diff_b
                    sd[f"{P}blocks.{b}.norm3.diff"] = torch.randn(DIM, generator=g) * 0.2
                    sd[f"{P}blocks.{b}.norm3.diff_b"] = torch.randn(DIM, generator=g) * 0.1
                    sd[f"{P}blocks.{b}.self_attn.norm_q.diff"] = torch.randn(DIM, generator=g) * 0.2
                else:  # as .w_norm / .b_norm
                    sd[f"{P}blocks.{b}.norm3.w_norm"] = torch.randn(DIM, generator=g) * 0.2
                    sd[f"{P}blocks.{b}.norm3.b_norm"] = torch.randn(DIM, generator=g) * 0.1
                    sd[f"{P}blocks.{b}.cross_attn.norm_k.w_norm"] = torch.randn(DIM, generator=g) * 0.2
                sd[f"{P}blocks.{b}.modulation.{m}"] = torch.randn(1, 6, DIM, generator=g) * 0.1
            sd[f"{P}head.modulation.{m}"] = torch.randn(1, 2, DIM, generator=g) * 0.1
    elif kind == "conv_patch_embedding":  # LoCon: down [r, 16, 1, 2, 2], up [128, r, 1, 1, 1]
        r, alpha, cin = 4, 4.0, 16
        fan_in = cin * 4
        down = torch.randn(r, cin, 1, 2, 2, generator=g) / math.sqrt(fan_in)
        up = torch.randn(DIM, r, 1, 1, 1, generator=g) * (0.5 * math.sqrt(r) / alpha)
        sd.update({f"{P}patch_embedding.lora_down.weight": down, f"{P}patch_embedding.lora_up.weight": up,
                   f"{P}patch_embedding.alpha": torch.tensor(alpha)})
    elif kind in ("dora_out", "dora_in"):
        base = load_base_weights(model_path)
        r, alpha = 4, 4.0
        for name, fi, fo in mods:
            # dW about twice the weight's own scale: ||W + s dW|| and ||W|| differ by about 2x
            down, up = _lora_factors(g, fi, fo, r, alpha, up_scale=2.0)
            wc = base[f"{name}.weight"] + (up @ down) * (alpha / r)
            if kind == "dora_out":
                n = wc.norm(dim=1, keepdim=True)  # [out, 1]
            else:
                n = wc.norm(dim=0, keepdim=True)  # [1, in]
            mag = n * (1.0 + 0.2 * torch.randn(n.shape, generator=g)).clamp(min=0.5)
            sd.update({f"{P}{name}.lora_down.weight": down, f"{P}{name}.lora_up.weight": up,
                       f"{P}{name}.alpha": torch.tensor(alpha), f"{P}{name}.dora_scale": mag})
    else:
        raise ValueError(kind)
    save_adapter_file({k: v.contiguous() for k, v in sd.items()}, path)
    return sd


def dora_as_diff(sd, model_path, convention):
    """The DoRA file `sd` (kohya LoRA + dora_scale, fp32) as a file of full `.diff` keys,
    W' - W with W' = m * (W + s dW) / (n + eps), computed here in fp32 from the bf16 base:
    convention "merged": n = norm of W + s dW (PEFT / LyCORIS; per row for [out, 1], per
    column for [1, in]); "original": n = per-row norm of the ORIGINAL W (what ComfyUI's
    weight_decompose does for an [out, 1] magnitude)."""
    base = load_base_weights(model_path)
    eps = torch.finfo(torch.float32).eps
    out = {}
    for k in [k for k in sd if k.endswith(".dora_scale")]:
        stem = k[:-len(".dora_scale")]
        name = stem[len("diffusion_model."):]
        down, up = sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"]
        alpha = float(sd[f"{stem}.alpha"])
        w = base[f"{name}.weight"]
        wc = w + (up @ down) * (alpha / down.shape[0])
        m = sd[k]
        if m.shape[0] == w.shape[0]:  # [out, 1]
            n = (w if convention == "original" else wc).norm(dim=1, keepdim=True)
        else:
            n = wc.norm(dim=0, keepdim=True)
        out[f"{stem}.diff"] = wc * (m / (n + eps)) - w
    return out


STYLE_A = "it_style_a.safetensors"     # rank 4, alpha 4, float32
STYLE_B = "it/it_style_b.safetensors"  # rank 8, alpha 4 (scale 0.5), bf16, in a subfolder


def install_model_and_lora(comfy, reference, lora: str, seed: int):
    """The reference tiny Wan checkpoint and one rank-4 kohya LoRA (alpha 4) named `lora` in the
    folders of a ComfyUI under test (`comfy.diffusion_models_dir`, `comfy.loras_dir`)."""
    shutil.copyfile(reference / MODEL, comfy.diffusion_models_dir / MODEL)
    write_kohya_lora(comfy.loras_dir / lora, seed=seed, rank=4, alpha=4)
    return comfy


def install_style_pair(comfy, reference):
    """`install_model_and_lora` with STYLE_A, and STYLE_B beside it."""
    install_model_and_lora(comfy, reference, STYLE_A, seed=101)
    write_kohya_lora(comfy.loras_dir / STYLE_B, seed=202, rank=8, alpha=4, dtype=torch.bfloat16)
    return comfy
