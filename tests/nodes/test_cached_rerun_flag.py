"""Every node that shows something on the node (a ``ui`` output: coverage or report) sets
``HAS_INTERMEDIATE_OUTPUT``, so ComfyUI 0.33+ re-sends its cached UI on a fully cached re-run
(a node without it shows no badge then, and /history holds no report). An output node is re-sent
anyway: with the flag too it would get the message twice."""
import inspect

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS


def test_every_node_that_returns_ui_sets_has_intermediate_output():
    with_ui = {name for name, cls in NODE_CLASS_MAPPINGS.items()
               if '"ui"' in inspect.getsource(cls)}
    assert {"LoraRuntimeLoadAdapter", "LoraRuntimeSampler", "LoraRuntimeReport", "LoraRuntimeStack",
            "LoraRuntimeLoadAdapterModelClip"} <= with_ui
    flag = {n: getattr(NODE_CLASS_MAPPINGS[n], "HAS_INTERMEDIATE_OUTPUT", False) for n in with_ui}
    output = {n for n in with_ui if getattr(NODE_CLASS_MAPPINGS[n], "OUTPUT_NODE", False)}
    assert output == {"LoraRuntimeReport"}
    assert sorted(n for n in with_ui - output if not flag[n]) == []
    assert sorted(n for n in output if flag[n]) == []
