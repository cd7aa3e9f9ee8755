"""The blocks syntax: which layers each entry selects, which factor a layer ends with, and one
clear error (naming the node and `blocks`) per mistake."""
import pytest

from comfyui_lora_runtime.lora_runtime.block_filter import block_of, groups, parse_blocks
from comfyui_lora_runtime.lora_runtime.errors import ConfigError

WAN = [f"blocks.{b}.{k}" for b in range(4) for k in ("self_attn.q", "cross_attn.k", "ffn.0", "ffn.2")] + \
      ["patch_embedding"]
FLUX = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1",
        "single_blocks.1.linear2", "final_layer.linear"]


def _resolve(text, names=WAN):
    return parse_blocks(text, where="Load LoRA Adapter (x.safetensors)").resolve(
        names, where="Load LoRA Adapter (x.safetensors)")


def test_block_of():
    assert block_of("blocks.3.self_attn.q") == ("blocks", 3)
    assert block_of("double_blocks.12.img_attn.qkv") == ("double_blocks", 12)
    assert block_of("transformer_blocks.7.attn1.to_q") == ("transformer_blocks", 7)
    assert block_of("layers.2.attention.qkv") == ("layers", 2)
    assert block_of("patch_embedding") is None and block_of("blocks_x.1") is None


def test_ranges_patterns_overrides_exclusions_and_only():
    f, out = _resolve("0-1: 0.5, cross_attn: 2, !ffn.2")
    assert f["blocks.0.self_attn.q"] == 0.5 and f["blocks.1.ffn.0"] == 0.5
    assert f["blocks.0.cross_attn.k"] == 2.0 and f["blocks.3.cross_attn.k"] == 2.0   # later entries win
    assert f["blocks.2.self_attn.q"] == 1.0 and f["patch_embedding"] == 1.0          # the rest keep 1
    assert sorted(out) == [f"blocks.{b}.ffn.2" for b in range(4)]
    f, out = _resolve("!ffn.2, *: 0.3")  # '!' wins wherever it stands; '*' may come last when nothing precedes it
    assert set(f.values()) == {0.3} and len(out) == 4
    f, out = _resolve("only 2-3\nffn: 0")
    assert sorted(f) == ["blocks.2.cross_attn.k", "blocks.2.self_attn.q", "blocks.3.cross_attn.k",
                         "blocks.3.self_attn.q"] and len(out) == len(WAN) - 4
    f, _ = _resolve("blocks.*.ffn.?: 0.25; ffn.0: 0.5")  # wildcards match the whole name; plain text a substring
    assert f["blocks.1.ffn.2"] == 0.25 and f["blocks.1.ffn.0"] == 0.5
    # a bare range selects that index in every block list; a qualified one in its own list
    f, _ = _resolve("0: 0.5, single_blocks.1: 0.1", FLUX)
    assert f == {"double_blocks.0.img_attn.qkv": 0.5, "double_blocks.1.txt_mlp.0": 1.0,
                 "single_blocks.0.linear1": 0.5, "single_blocks.1.linear2": 0.1, "final_layer.linear": 1.0}
    assert parse_blocks("") is None and parse_blocks("  ,  ") is None


def test_groups_for_the_report():
    f, out = _resolve("0-1: 0.5, !cross_attn")
    g = groups(f, out)
    assert g == {"strengths": [{"factor": 0.5, "layers": 6, "where": "blocks 0-1"},
                               {"factor": 1.0, "layers": 7, "where": "blocks 2-3; 1 outside blocks"}],
                 "excluded": 4, "excluded_where": "blocks 0-3"}


@pytest.mark.parametrize("text,says", [
    ("0-9", "entry '0-9' has no strength; write '0-9: 0.5'"),
    ("0: x", "entry '0: x': strength 'x' is not a number"),
    ("0: 11", "strength 11 is out of range"),
    ("0: nan", "strength nan is out of range"),
    ("9-3: 1", "the range 9-3 runs backwards; write 3-9"),
    ("cross attn: 1", "'cross attn' is neither a block range"),
    ("!", "entry '!' names no blocks or layers"),
    ("only", "entry 'only' names no blocks or layers"),
    (": 1", "entry ': 1' names no blocks or layers"),
    ("0: 0.5, *: 1", "entry '0: 0.5' has no effect: the later '*: 1' overrides every layer"),
])
def test_syntax_mistakes(text, says):
    with pytest.raises(ConfigError) as ei:
        parse_blocks(text, where="LoRA Stack row 2 (x.safetensors)")
    msg = str(ei.value)
    assert msg.startswith("LoRA Stack row 2 (x.safetensors): blocks ") and says in msg, msg


@pytest.mark.parametrize("text,says", [
    ("10-19: 0.5", "entry '10-19: 0.5' selects none of the 17 layers this adapter changes (blocks 0-3; 1 layer(s) "
                   "outside blocks such as patch_embedding"),
    ("double_blocks.0: 1", "selects none"),
    ("*: 0", "leaves out every one of the 17 layers"),
    ("only 1, !1", "leaves out every one"),
])
def test_entries_that_select_nothing_or_leave_nothing(text, says):
    with pytest.raises(ConfigError) as ei:
        _resolve(text)
    assert says in str(ei.value) and str(ei.value).startswith("Load LoRA Adapter (x.safetensors): blocks "), \
        str(ei.value)


def test_text_that_is_not_text():
    with pytest.raises(ConfigError, match="blocks must be text"):
        parse_blocks(3)
