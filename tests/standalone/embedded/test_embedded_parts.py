"""Codec, text encoder and judge of the embedded model, on fresh rendered glyphs."""
from __future__ import annotations

import pytest
import torch

from comfyui_lora_runtime.standalone import embedded as E
from comfyui_lora_runtime.standalone.embedded import data as D
from comfyui_lora_runtime.standalone.embedded.codec import psnr
from comfyui_lora_runtime.standalone.host import latent_format

HELD_OUT_SEED = 70001  # the training script renders from seeds < 1100


@pytest.fixture(scope="module")
def held_out():
    imgs, digits, colours = D.render_batch(300, HELD_OUT_SEED)
    outl, od, oc = D.render_batch(300, HELD_OUT_SEED + 1, outlined=True)
    return D.to_float(imgs), digits, colours, D.to_float(outl), od, oc


# -- data ----------------------------------------------------------------------------

def test_rendering_is_deterministic_and_centred():
    a, da, ca = D.render_batch(8, 5)
    b, db, cb = D.render_batch(8, 5)
    assert torch.equal(a, b) and torch.equal(da, db) and torch.equal(ca, cb)
    c, _, _ = D.render_batch(8, 6)
    assert not torch.equal(a, c)  # another seed, other glyphs
    assert a.shape == (8, 64, 64, 3) and a.dtype == torch.uint8
    lit = a.float().sum(-1) > 0  # [8, 64, 64]
    ys, xs = torch.nonzero(lit.any(0), as_tuple=True)
    assert 8 <= int(ys.min()) and int(ys.max()) <= 56 and 8 <= int(xs.min()) and int(xs.max()) <= 56


def test_colour_of_rendered_glyphs():
    imgs, _, colours = D.render_batch(40, 9)
    for img, c in zip(imgs, colours):
        rgb = torch.tensor(D.COLOURS[D.COLOUR_NAMES[int(c)]])
        lit = img.reshape(-1, 3)[img.reshape(-1, 3).sum(1) > 0].float()
        direction = lit / lit.norm(dim=1, keepdim=True)
        assert torch.allclose(direction.mean(0), rgb / rgb.float().norm(), atol=1e-3)


# -- codec ---------------------------------------------------------------------------

def test_codec_psnr_on_held_out_images(codec, held_out):
    x, _, _, xo, _, _ = held_out
    latent = codec.encode(x)
    assert latent.shape == (300, 16, 1, 8, 8) and latent.dtype == torch.float32
    rec = codec.decode(latent)
    assert rec.shape == x.shape and float(rec.min()) >= 0.0 and float(rec.max()) <= 1.0
    good = psnr(rec, x)
    assert good >= 30.0, f"codec PSNR {good:.2f} dB < 30 dB"
    assert psnr(codec.decode(codec.encode(xo)), xo) >= 29.0  # outlined glyphs: thin strokes, measured 30.3
    # wrong answer: another image's latent decodes to something far away
    wrong = psnr(codec.decode(latent.roll(1, dims=0)), x)
    assert wrong < good - 8.0, (good, wrong)


def test_codec_latents_are_single_scale_after_process_in(codec, held_out):
    """ComfyUI's process_in turns the codec's raw latent into the one-scale latent the DiT was trained on."""
    x = held_out[0]
    raw = codec.encode(x)
    model_space = latent_format.process_in(raw)
    assert torch.allclose(model_space, codec.encode_model(x), atol=1e-5)
    assert 0.8 < float(model_space.std()) < 1.25  # ONE shared scale: unit variance overall
    per_channel = model_space.std(dim=(0, 2, 3, 4))
    assert float(per_channel.max() / per_channel.min()) > 2.0  # not per-channel standardised
    # the raw (VAE-space) latent is not the model-space one: process_out was applied
    assert not torch.allclose(raw, model_space, atol=1e-2)


def test_the_learned_decoder_is_what_makes_it_clean(codec, held_out):
    """Wrong answer: the same latents through the PCA alone (+ tone curve) decode at ~26 dB."""
    import copy
    x, _, _, xo, _, _ = held_out
    assert codec.decoder is not None
    linear = copy.copy(codec)
    linear.set_decoder(None)
    assert psnr(linear.decode(codec.encode(x)), x) < 27.5
    assert psnr(codec.decode(codec.encode(x)), x) >= psnr(linear.decode(codec.encode(x)), x) + 3.0
    # sampled latents are noisy: the decoder was trained on noisy latents and stays closer
    noisy = codec.encode_model(x[:100]) + 0.1 * torch.randn((100, 16, 1, 8, 8), generator=torch.Generator().manual_seed(1))
    assert psnr(codec.decode_model(noisy), x[:100]) > psnr(linear.decode_model(noisy), x[:100])


def test_codec_file_round_trip(codec, tmp_path):
    from comfyui_lora_runtime.standalone.embedded.codec import TinyCodec
    codec.save(tmp_path / "c.safetensors")
    again = TinyCodec.load(tmp_path / "c.safetensors")
    z = torch.randn(2, 16, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(again.decode(z), codec.decode(z))
    from safetensors.torch import load_file, save_file
    sd = load_file(str(tmp_path / "c.safetensors"))
    sd["dec.c2.weight"] = sd["dec.c2.weight"][:5]
    save_file(sd, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="dec.c2.weight"):
        TinyCodec.load(tmp_path / "bad.safetensors")


# -- text encoder --------------------------------------------------------------------

def test_text_encoder_shapes_and_determinism(text_encoder):
    from comfyui_lora_runtime.standalone.embedded.text_encoder import TinyTextEncoder
    c = text_encoder.encode("red 7")
    assert c.shape == (1, 4, 4096) and c.dtype == torch.float32
    assert torch.equal(c, text_encoder.encode("  Red, 7 "))
    assert torch.equal(c, TinyTextEncoder.load(E.TEXT_ENCODER).encode("red 7"))
    assert not torch.equal(c, text_encoder.encode("red 1"))
    assert not torch.equal(c, text_encoder.encode("blue 7"))
    empty = text_encoder.encode("")
    assert empty.shape == c.shape
    assert torch.equal(empty[0, 0], empty[0, 3])  # all padding: the unconditional conditioning
    assert not torch.equal(empty, c)
    batch = text_encoder.encode_batch(["red 7", "green 2"])
    assert batch.shape == (2, 4, 4096) and torch.equal(batch[:1], c)


def test_text_encoder_rejects_unknown_words(text_encoder):
    with pytest.raises(ValueError) as exc:
        text_encoder.encode("purple 7")
    msg = str(exc.value)
    assert "'purple'" in msg
    for word in text_encoder.VOCAB:
        assert word in msg
    with pytest.raises(ValueError, match="'seven'"):
        text_encoder.encode("red seven")
    text_encoder.encode("white 0")  # the right answer passes


# -- judge ---------------------------------------------------------------------------

def test_judge_accuracy_on_fresh_rendered_images(judge, held_out):
    x, d, c, xo, od, oc = held_out
    v, vo = judge(x), judge(xo)
    digit = float(torch.cat([v.digit == d, vo.digit == od]).float().mean())
    colour = float(torch.cat([v.colour == c, vo.colour == oc]).float().mean())
    outline = float(torch.cat([~v.outlined, vo.outlined]).float().mean())
    assert digit >= 0.98 and colour >= 0.98 and outline >= 0.98, (digit, colour, outline)
    # wrong answer: the same verdicts against shifted labels are near chance
    assert float((v.digit == (d + 1) % 10).float().mean()) < 0.2
    assert float((v.colour == (c + 1) % 4).float().mean()) < 0.2


def test_judge_reads_codec_decoded_images(judge, codec, held_out):
    x, d, c, _, _, _ = held_out
    v = judge(codec.decode(codec.encode(x)))
    assert float((v.digit == d).float().mean()) >= 0.98
    assert float((v.colour == c).float().mean()) >= 0.98
    assert float(v.outlined.float().mean()) <= 0.02
