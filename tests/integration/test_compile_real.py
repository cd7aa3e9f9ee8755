"""ComfyUI's TorchCompileModel (inductor, CPU) after our loader in a real ComfyUI (opt-in, COMFYUI_DIR).

One compile, then two strength changes: each prompt re-runs our loader and TorchCompileModel (a new
MODEL clone, a new compiled wrapper), and the report of the compiled KSampler says how many graphs
torch.compile built during that sampling: some the first time, none after a strength change. The
same for a LoKr and a per-row DoRA file (their trace forms), not only plain LoRA. Each
compiled latent matches the uncompiled KSampler of the same prompt (PSNR: inductor fuses and
reorders the DiT's float ops) and differs from the no-adapter latent."""
from __future__ import annotations

import pytest

from testkit.comfyui.prompts import LORA_A, Prompt, assert_changed, assert_psnr, latent_of, reports_sent
from testkit.lora_assets import MODEL, write_variant_file

VARIANTS = {"lokr_w1_w2ab": "it_compile/lokr.safetensors", "dora_out": "it_compile/dora_out.safetensors"}

STRENGTHS = (1.0, 0.5, 1.5)
COMPILE_TIMEOUT = 1800.0  # inductor's first CPU compile of the DiT: minutes, more on a busy machine


def _report_of(record, node):
    reps = [e["report"] for e in reports_sent(record) if str(e.get("node")) == node]
    assert reps, f"no runtime report was sent for node {node}"
    return reps[-1]


@pytest.mark.parametrize("adapter", ["lora", *VARIANTS])
def test_torch_compile_model_after_our_loader_does_not_recompile(assets, reference, cond_class, no_adapter,
                                                                 adapter):
    name = LORA_A
    if adapter in VARIANTS:
        name = VARIANTS[adapter]
        (assets.loras_dir / name).parent.mkdir(exist_ok=True)
        write_variant_file(assets.loras_dir / name, adapter, seed=1700, model_path=reference / MODEL)
    for i, strength in enumerate(STRENGTHS):
        p = Prompt(cond_class)
        m = p.ours(["1", 0], [(name, strength)], "dynamic", "lossless")
        compiled = p.node("30", "TorchCompileModel", model=m, backend="inductor")
        p.ksampler("5", compiled)
        p.ksampler("6", m)
        record = assets.run(p.p, timeout=COMPILE_TIMEOUT)
        out = {nid: latent_of(assets, record, save) for nid, save in p.samplers.items()}
        assert all(nid in record["executing"] for nid in p.samplers), record["cached"]
        assert_psnr(out["5"], out["6"], f"compiled vs uncompiled at strength {strength}")
        assert_changed(out["5"], no_adapter, f"compiled at strength {strength}")
        graphs = (_report_of(record, "5").get("compile") or {}).get("graphs_compiled", 0)
        if i == 0:
            assert graphs >= 1, "the first compiled sampling compiled nothing: the compile wrapper did not run"
        else:
            assert graphs == 0, f"strength {strength}: torch.compile built {graphs} graphs again (recompiled)"
        assert not (_report_of(record, "5").get("compile") or {}).get("fallbacks"), "recompile limit hit"
