"""Malformed adapter configs and layers, built here at test time: each is refused with an
`AdapterFormatError` naming the file and the key (at load and in the header check the
prompt validation runs), nothing in the model changes, and no pattern key makes matching
hang. Typed booleans and PEFT's pattern semantics are checked on the applied output
against the intended scale and the wrong one."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from comfyui_lora_runtime.lora_runtime import AdapterFormatError, AdapterSpec, applied, plan
from comfyui_lora_runtime.lora_runtime.files.header_check import check_adapter_file
from comfyui_lora_runtime.lora_runtime.files.pattern_match import Pattern

from testkit.scale_checks import R, X, check_scale as _check, peft_sd as _peft_sd


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _refused(model, path, *words):
    """Loading `path` for a run fails naming the file and each word; the weights are untouched;
    the prompt-time header check says the same."""
    before = _snapshot(model)
    with pytest.raises(AdapterFormatError) as e:
        with applied(model, plan(model, [AdapterSpec(str(path))], "merge", "exact"), fusion_backend=None):
            pass
    msg = str(e.value)
    for w in (path.name, *words):
        assert w in msg, msg
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return msg


def _with_cfg(tmp_path, pairs, name, cfg):
    p = tmp_path / name
    save_file(_peft_sd(pairs), str(p), metadata={"adapter_config": json.dumps(cfg)})
    return p


MALFORMED = [
    ("pattern_list.safetensors", {"r": R, "lora_alpha": 8, "alpha_pattern": ["ffn.0", 2]}, "alpha_pattern"),
    ("pattern_bad_regex.safetensors", {"r": R, "lora_alpha": 8, "alpha_pattern": {"ffn.[0": 2}}, "'ffn.[0'"),
    ("pattern_backref.safetensors", {"r": R, "alpha_pattern": {r"(ffn)\.\1": 2}}, r"'(ffn)\\.\\1'"),
    ("pattern_huge.safetensors", {"r": R, "rank_pattern": {"(a{200}){200}": 2}}, "'(a{200}){200}'"),
    ("pattern_value.safetensors", {"r": R, "alpha_pattern": {"ffn.0": "two"}}, "alpha_pattern['ffn.0']"),
    ("rank_pattern_value.safetensors", {"r": R, "rank_pattern": {"ffn.0": 2.5}}, "rank_pattern['ffn.0']"),
    ("alpha_text.safetensors", {"r": R, "lora_alpha": "sixteen"}, "lora_alpha"),
    ("alpha_bool.safetensors", {"r": R, "lora_alpha": True}, "lora_alpha"),
    ("alpha_list.safetensors", {"r": R, "lora_alpha": [8]}, "lora_alpha"),
    ("r_zero.safetensors", {"r": 0, "lora_alpha": 8}, "r = 0"),
    ("rslora_word.safetensors", {"r": R, "lora_alpha": 8, "use_rslora": "yes"}, "use_rslora"),
    ("rslora_number.safetensors", {"r": R, "lora_alpha": 8, "use_rslora": 1}, "use_rslora"),
]


@pytest.mark.parametrize("name,cfg,word", MALFORMED, ids=[m[0].split(".")[0] for m in MALFORMED])
def test_a_malformed_config_value_is_an_error_naming_the_file_and_key(model, pairs, tmp_path, name, cfg, word):
    p = _with_cfg(tmp_path, pairs, name, cfg)
    msg = _refused(model, p, word)
    assert check_adapter_file(p) == msg  # the same words when the prompt is validated, before anything runs


def test_a_config_that_is_json_but_not_an_object_is_an_error(model, pairs, tmp_path):
    p = tmp_path / "cfg_list.safetensors"
    save_file(_peft_sd(pairs), str(p), metadata={"adapter_config": json.dumps([{"lora_alpha": 8}])})
    _refused(model, p, "adapter_config", "list")


def test_deeply_nested_config_json_is_an_error_not_a_recursion_error(model, pairs, tmp_path):
    p = tmp_path / "cfg_deep.safetensors"
    save_file(_peft_sd(pairs), str(p), metadata={"adapter_config": "[" * 200_000 + "]" * 200_000})
    _refused(model, p, "adapter_config", "nested too deeply")


@pytest.mark.parametrize("value,rs", [("false", False), ("False", False), (False, False), ("TRUE", True),
                                      (True, True)])
def test_use_rslora_is_read_as_a_boolean(model, pairs, tmp_path, value, rs):
    """'false' as a string once turned rsLoRA on (alpha/sqrt(r) = 4 instead of alpha/r = 2)."""
    p = _with_cfg(tmp_path, pairs, "rs.safetensors", {"r": R, "lora_alpha": 8, "use_rslora": value})
    want = 8 / R ** 0.5 if rs else 8 / R
    wrong = 8 / R if rs else 8 / R ** 0.5
    _check(model, pairs, p, lambda n: want, X, "lora_alpha")
    with pytest.raises(AssertionError):  # the other reading is told apart by the same check
        _check(model, pairs, p, lambda n: wrong, X, "lora_alpha")


def test_regex_pattern_keys_follow_peft_first_match_after_a_dot(model, pairs, tmp_path):
    """Keys are regexes matched against the module path or a suffix after a dot, first key wins
    (PEFT's order); 'q' must not match 'blocks.0.self_attn.q' via 'attn.q' being a substring only."""
    cfg = {"r": R, "lora_alpha": 8, "alpha_pattern": {
        r"blocks\.1\.(self|cross)_attn\.[qk]": 2,     # regex: alternation and a class
        r"(ffn\.)+0": 3,                                # a quantified group (suffix after a dot)
        r"ttn\.o": 5,                                   # not after a dot: must never match
        r"ffn\.\d": 6,                                  # ffn.2 (ffn.0 was taken by the earlier key)
    }}
    p = _with_cfg(tmp_path, pairs, "regex_pat.safetensors", cfg)

    def scale(n):
        if n.startswith("blocks.1.") and n.split(".")[-1] in "qk" and "attn" in n:
            return 2 / R
        if n.endswith("ffn.0"):
            return 3 / R
        if n.endswith("ffn.2"):
            return 6 / R
        return 8 / R
    _check(model, pairs, p, scale, X, "alpha_pattern")


def test_pattern_matching_agrees_with_python_re_on_random_keys():
    """The bounded matcher answers PEFT's re.match(rf'(.*\\.)?({key})$', path) exactly."""
    import random
    import re
    rng = random.Random(0)
    atoms = ["a", "b", ".", r"\.", "[ab]", "[^a]", r"\d", "1", "(a|b)", "(?:ab)", "^", "$", r"\w", "(a.b)"]
    quants = ["", "", "*", "+", "?", "{2}", "{1,3}", "*?", "{0,2}"]
    checked = 0
    for _ in range(3000):
        key = "".join(rng.choice(atoms) + rng.choice(quants) for _ in range(rng.randint(1, 4)))
        try:
            ref = re.compile(rf"(.*\.)?({key})$")
        except re.error:
            continue
        pat = Pattern(key)
        for _ in range(8):
            path = "".join(rng.choice("ab.1_") for _ in range(rng.randint(0, 8)))
            assert pat.matches(path) == bool(ref.match(path)), (key, path)
            checked += 1
    assert checked > 10_000


def test_a_catastrophic_pattern_key_loads_in_bounded_time(tmp_path):
    """'(a+)+$'-style keys make re.fullmatch backtrack exponentially on a path they do not
    match; loading must finish. Run in a child process so a regression fails instead of hanging."""
    code = textwrap.dedent(f"""
        import json, sys, torch
        from safetensors.torch import save_file
        from comfyui_lora_runtime.lora_runtime import load_adapter
        sd = {{}}
        for i in range(4):
            stem = "a" * 40 + "b.x%d" % i   # the whole path can be eaten by a+ before failing
            sd[stem + ".lora_A.weight"] = torch.ones(2, 4)
            sd[stem + ".lora_B.weight"] = torch.ones(4, 2)
        cfg = {{"r": 2, "lora_alpha": 2, "alpha_pattern": {{"(a+)+c": 1, "(a|aa)*c": 1, "(a*)*c": 1}}}}
        p = {str(tmp_path / 'evil.safetensors')!r}
        save_file(sd, p, metadata={{"adapter_config": json.dumps(cfg)}})
        ad = load_adapter(p)
        print("loaded", len(ad.layers))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ})
    assert r.returncode == 0 and "loaded 4" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("with_alpha", [True, False])
def test_a_rank_0_layer_is_refused_naming_the_key(model, pairs, tmp_path, with_alpha):
    sd = {}
    for name, (down, up) in pairs.items():
        stem = "diffusion_model." + name
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
    stem = "diffusion_model.blocks.0.ffn.0"
    sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = torch.zeros(0, 32), torch.zeros(64, 0)
    if with_alpha:
        sd[f"{stem}.alpha"] = torch.tensor(4.0)
    p = tmp_path / f"rank0_{with_alpha}.safetensors"
    save_file(sd, str(p))
    msg = _refused(model, p, stem, "rank-0")
    assert check_adapter_file(p) in ("", msg)  # the header check may not read tensors; the run refuses


def test_an_integer_alpha_tensor_is_read_as_its_value(model, pairs, tmp_path):
    """ComfyUI reads .alpha with .item(), so an int64 alpha of 2 means scale 2 / rank, not 1."""
    sd = {}
    for name, (down, up) in pairs.items():
        stem = "diffusion_model." + name
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
        sd[f"{stem}.alpha"] = torch.tensor(2, dtype=torch.int64)
    p = tmp_path / "int_alpha.safetensors"
    save_file(sd, str(p))
    _check(model, pairs, p, lambda n: 2 / R, X, "per-layer .alpha")


def test_a_boolean_alpha_tensor_is_refused(model, pairs, tmp_path):
    sd = {}
    for name, (down, up) in pairs.items():
        stem = "diffusion_model." + name
        sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down.contiguous(), up.contiguous()
    sd["diffusion_model.blocks.0.ffn.0.alpha"] = torch.tensor(True)
    p = tmp_path / "bool_alpha.safetensors"
    save_file(sd, str(p))
    _refused(model, p, "diffusion_model.blocks.0.ffn.0.alpha")


def test_the_matching_work_of_one_config_is_bounded(tmp_path, monkeypatch):
    """Keys within the supported subset still cost (path length x automaton states) each; the
    total for one file is capped and the key that ran over it is named."""
    from comfyui_lora_runtime.lora_runtime import load_adapter
    from comfyui_lora_runtime.lora_runtime.files import pattern_match
    monkeypatch.setattr(pattern_match, "MAX_WORK", 2_000)
    monkeypatch.setattr(pattern_match.Budget.__init__, "__defaults__", (2_000,))
    sd = {}
    for i in range(20):
        stem = f"base_model.model.blocks.{i}.ffn.{'a' * 30}"
        sd[stem + ".lora_A.weight"], sd[stem + ".lora_B.weight"] = torch.ones(2, 4), torch.ones(4, 2)
    p = tmp_path / "costly.safetensors"
    save_file(sd, str(p), metadata={"adapter_config": json.dumps(
        {"r": 2, "lora_alpha": 2, "alpha_pattern": {"(a|aa)*c": 1}})})
    with pytest.raises(AdapterFormatError, match=r"costly.safetensors: pattern key '\(a\|aa\)\*c'.*automaton steps"):
        load_adapter(p)
