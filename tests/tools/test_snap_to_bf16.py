"""tools/train_embedded.snap_to_bf16_keeping: the bf16 matrix that holds a large component
orthogonal to the contexts while keeping the layer's outputs on those contexts.

Compared with the wrong answer (plain round-to-nearest of ``w + K``), on a layer shaped
like the embedded model's cross-attention k/v (128 x 128, 15 contexts, +-8 component)."""
import torch

from comfyui_lora_runtime.tools import train_embedded


def test_snapped_weight_keeps_the_outputs_on_the_contexts():
    snap = train_embedded.snap_to_bf16_keeping
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(128, 128, generator=g, dtype=torch.float64) * 0.08).to(torch.bfloat16).double()
    ctx = torch.randn(128, 15, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(ctx)
    k = (torch.randint(0, 2, (128, 128), generator=g).double() * 2 - 1) * 8.0
    k = k - (k @ q) @ q.T  # K @ ctx == 0: the component changes nothing on the contexts
    target = w + k
    snapped = snap(w, target, ctx)
    assert snapped.dtype == torch.bfloat16
    s = snapped.double()
    plain = target.to(torch.bfloat16).double()  # the wrong answer: round to nearest

    def rel(m):
        return float(((m - w) @ ctx).norm() / (w @ ctx).norm())

    # plain rounding moves the outputs ~16 % (up to half an ulp of +-8 on every entry);
    # snapping keeps them within a few % (measured 1.7 %), >= 5x better
    assert rel(plain) > 0.1
    assert rel(s) < rel(plain) / 5, (rel(s), rel(plain))
    # still the inflated matrix: every entry within a few bf16 ulps (ulp of 8 = 2^-4) of w + K
    assert float((s - target).abs().max()) <= 4 * 2.0 ** -4
    assert float((s - w).abs().mean()) > 4.0
