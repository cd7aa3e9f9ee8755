"""Launch configs per shape bucket: the key rounds M, the committed table wins over
tuning, tuning happens once per bucket, and every candidate config computes the same
result as the reference (CUDA), so whatever a table or the tuner picks is correct."""
import json

import pytest
import torch
from testkit.compare import assert_close, order_atol

from comfyui_lora_runtime.kernels import launch_configs as lc


def test_m_bucket_rounds_up_to_powers_of_two():
    assert [lc.m_bucket(m) for m in (1, 16, 17, 512, 513, 1530, 3060, 4096, 32760, 10 ** 6)] == \
        [16, 16, 32, 512, 1024, 2048, 4096, 4096, 32768, 65536]


def test_family_names():
    assert lc.family_names("NVIDIA H200", (9, 0)) == ["nvidia-h200", "sm90"]
    assert lc.family_names("NVIDIA GeForce RTX 4090", (8, 9)) == ["nvidia-geforce-rtx-4090", "sm89"]


def _table(tmp_path, entries):
    (tmp_path / "gpu-x.json").write_text(json.dumps({"device": "GPU X", "entries": entries}))


def test_table_beats_tuning_and_the_cache_keeps_one_choice_per_bucket(tmp_path, monkeypatch):
    key = lc.BucketKey("linear_gelu_tanh", "bfloat16", 8960, 1536, 2048)
    cfg = lc.LaunchConfig(64, 128, 64, 4, 4)
    _table(tmp_path, [dict(key.as_dict(), config=cfg.meta())])
    monkeypatch.setattr(lc, "TABLE_DIR", tmp_path)
    monkeypatch.setattr(lc, "_device_families", lambda device: ["gpu-x", "sm00"])
    tuned = []
    monkeypatch.setattr(lc, "tune_bucket", lambda launch: tuned.append(1) or (lc.CANDIDATES[0], {}))
    lc.forget()
    try:
        assert lc.choose(key, "cuda:0", launch=None) == cfg and not tuned
        other = lc.BucketKey("linear_gelu_tanh", "bfloat16", 8960, 1536, 4096)
        small = lc.BucketKey("linear_gelu_tanh", "bfloat16", 64, 64, 16)
        assert lc.choose(small, "cuda:0", launch=None) == lc.SMALL_DEFAULT and not tuned
        assert lc.choose(other, "cuda:0", launch=None) == lc.CANDIDATES[0] and tuned == [1]
        assert lc.choose(other, "cuda:0", launch=None) == lc.CANDIDATES[0] and tuned == [1]  # cached
        with lc.pinned(lc.CANDIDATES[3]):
            assert lc.choose(key, "cuda:0", launch=None) == lc.CANDIDATES[3]
        assert lc.choose(key, "cuda:0", launch=None) == cfg
    finally:
        lc.forget()


def test_a_bad_table_names_its_file(tmp_path, monkeypatch):
    _table(tmp_path, [{"op": "linear_gelu_tanh", "config": {}}])
    with pytest.raises(ValueError, match=r"gpu-x\.json.*refresh the table"):
        lc._tables.pop("gpu-x", None)
        lc.load_table("gpu-x", tmp_path)


def test_committed_tables_parse():
    for path in sorted(lc.TABLE_DIR.glob("*.json")):
        table = lc._parse_table(json.loads(path.read_text()), str(path))
        assert table, f"{path} has no entries"
        assert all(c in lc.CANDIDATES for c in table.values()), f"{path} holds a config that is not a candidate"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("cfg", lc.CANDIDATES, ids=lambda c: c.label().replace(" ", "_"))
def test_every_candidate_is_correct(cfg):
    from testkit.linear_gelu_checks import check as check_gelu, make as make_gelu
    from testkit.lora_linear_checks import check as check_lora, check_not_wrong, make as make_lora

    from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh
    from comfyui_lora_runtime.kernels.lora_linear import lora_linear

    with lc.pinned(cfg):
        x, w, b = make_gelu((301, 200), 333, torch.bfloat16, "cuda")
        check_gelu(linear_gelu_tanh(x, w, b, backend="triton"), x, w, b, f"gelu {cfg.label()}")
        for dtype in (torch.bfloat16, torch.float16):
            args = make_lora((301, 200), 333, dtype, "cuda", adapters="several")
            y = lora_linear(*args, gelu=True, backend="triton")
            check_lora(y, args, True, f"lora {dtype} {cfg.label()}")
            check_not_wrong(y, args, True, "several", "cuda")


@needs_cuda
def test_one_tuning_per_bucket_on_cuda():
    from comfyui_lora_runtime.kernels.linear_gelu_tanh import linear_gelu_tanh
    lc.forget()
    try:
        w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
        for m in (1000, 1024, 700):  # 700 -> bucket 1024 as well
            linear_gelu_tanh(torch.randn(m, 256, device="cuda", dtype=torch.bfloat16), w, backend="triton")
        keys = [k for _, k, _ in lc.cached_entries() if k.op == "linear_gelu_tanh" and k.N == 384]
        assert keys == [lc.BucketKey("linear_gelu_tanh", "bfloat16", 384, 256, 1024)]
        x = torch.randn(700, 256, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.gelu(x.float() @ w.float().t(), approximate="tanh").to(torch.bfloat16)
        # order_atol: cuBLAS and the kernel sum the same fp32 products in different orders
        assert_close(linear_gelu_tanh(x, w, backend="triton"), ref, atol=1e-6 + order_atol(x, w), rtol=2 ** -7, name="bucketed launch")
    finally:
        lc.forget()
