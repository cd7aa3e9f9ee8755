"""Saved UI workflows leave room for their content in any font, and no node covers another.

ComfyUI's editor makes each node at least as large as its content measured in the font the
browser has (title 14 px, labels 12 px "Arial"; DejaVu Sans where that is the only font, about
16 % wider than Arial's metrics). A node saved just wide enough for Arial was drawn wider with
DejaVu and covered its neighbour (the negative prompt: saved 300 wide, drawn 334). Here every
text is measured with a generous per-character estimate that is checked against DejaVu Sans
Bold's advances (wider than the regular face a browser uses), and each saved node must hold its
title whole (the editor draws it in the width less two title heights), each widget's label and
value, its slot labels, and the height of its slots and widgets; boxes, title bars included,
must keep a gap between them. The browser test (tests/integration/test_browser.py) checks the
drawn layout with DejaVu Sans as the only font.
"""
import json
from pathlib import Path

import pytest

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS
from comfyui_lora_runtime.tools import make_workflows as mw
from comfyui_lora_runtime.tools import workflow_layout as layout

ROOT = Path(__file__).resolve().parents[2]
UI = ROOT / "workflows"
NAMES = sorted(p.stem for p in UI.glob("*.json"))
CLASSES = {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}

# DejaVu Sans Bold 2.37 (fontversion 155320), advance of each printable ASCII character in em
# (PIL ImageFont.getlength at 2048 px / 2048), characters 32..126 in order.
DEJAVU_SANS_BOLD_EM = [
    0.348, 0.456, 0.521, 0.838, 0.696, 1.002, 0.872, 0.306, 0.457, 0.457, 0.523, 0.838, 0.38, 0.415, 0.38, 0.365,
    0.696, 0.696, 0.696, 0.696, 0.696, 0.696, 0.696, 0.696, 0.696, 0.696, 0.4, 0.4, 0.838, 0.838, 0.838, 0.58, 1.0,
    0.774, 0.762, 0.734, 0.83, 0.683, 0.683, 0.821, 0.837, 0.372, 0.372, 0.775, 0.637, 0.995, 0.837, 0.85, 0.733,
    0.85, 0.77, 0.72, 0.682, 0.812, 0.774, 1.103, 0.771, 0.724, 0.725, 0.457, 0.365, 0.457, 0.838, 0.5, 0.5, 0.675,
    0.716, 0.593, 0.716, 0.678, 0.435, 0.716, 0.712, 0.343, 0.343, 0.665, 0.343, 1.042, 0.712, 0.687, 0.716, 0.716,
    0.493, 0.595, 0.478, 0.712, 0.652, 0.924, 0.645, 0.652, 0.582, 0.712, 0.365, 0.712, 0.838]
# the negative prompt's title in DejaVu Sans at 14 px (PIL): with LiteGraph's 40 of title margins, the 334 drawn
NEGATIVE_TITLE = "Negative prompt (empty = unconditional)"
NEGATIVE_TITLE_DEJAVU_PX = 294.06
GAP = 20  # the least room kept between two nodes' boxes (title bars included)
SLOT, WIDGET, TEXTBOX, BELOW = 20, 24, 54, 14  # a slot row; a widget and its gap; a text box (min 50); under them


def test_the_estimate_is_at_least_dejavu_sans_bold_for_every_ascii_character():
    for code, em in zip(range(32, 127), DEJAVU_SANS_BOLD_EM, strict=True):
        assert layout.char_em(chr(code)) >= em, (chr(code), layout.char_em(chr(code)), em)
    assert layout.text_width(NEGATIVE_TITLE, 14) > NEGATIVE_TITLE_DEJAVU_PX


def required(node: dict) -> tuple[float, float]:
    """The least [width, height] the saved node needs in any font (the editor's measures)."""
    sockets, widgets, outputs, _ = mw.signature(node["type"], CLASSES)
    title = node.get("title") or mw.title_of(node["type"], {"nodes": {}}, node["id"])
    need_w = layout.text_width(title, 14) + 2 * 30
    need_w = max(need_w, max((layout.text_width(n, 12) for n, _ in sockets), default=0)
                 + max((layout.text_width(n, 12) for n, _ in outputs), default=0) + 2 * 20 + 5)
    multi = mw.multiline_widgets(node["type"], CLASSES)
    height = max(len(sockets), len(outputs), 1) * SLOT
    if node["type"] == "LoraRuntimeStack":
        shown = mw.shown_widgets(node["type"], CLASSES, {"rows": node["widgets_values"][0],
                                                         "unmatched_keys": node["widgets_values"][1]})
        rows = [(label, value, False) for label, value, _ in shown]
    else:
        values = iter(node["widgets_values"])
        rows = []
        for name, control in widgets:
            rows.append((name, layout.value_text(next(values)), name in multi))
            if control:
                rows.append(("control after generate", str(next(values)), False))
    for label, value, textbox in rows:
        if textbox:
            height += TEXTBOX
        else:
            need_w = max(need_w, layout.text_width(label, 12) + layout.text_width(value, 12) + 2 * (15 + 6 + 10))
            height += WIDGET
    return need_w, height + (BELOW if rows else 6)


def problems(ui: dict) -> list[str]:
    out = []
    nodes = ui["nodes"]
    for n in nodes:
        w, h = required(n)
        if n["size"][0] < w or n["size"][1] < h:
            out.append(f"node {n['id']} ({n.get('title') or n['type']}): size {n['size']} < needed "
                       f"[{w:.0f}, {h:.0f}]")
    boxes = {n["id"]: (n["pos"][0], n["pos"][1] - 30, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
             for n in nodes}
    ids = sorted(boxes)
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            ax0, ay0, ax1, ay1 = boxes[a]
            bx0, by0, bx1, by1 = boxes[b]
            if min(ax1, bx1) + GAP > max(ax0, bx0) and min(ay1, by1) + GAP > max(ay0, by0):
                out.append(f"nodes {a} and {b} are closer than {GAP}: {boxes[a]} {boxes[b]}")
    return out


@pytest.mark.parametrize("name", NAMES)
def test_saved_nodes_hold_their_content_in_any_font_and_keep_apart(name):
    ui = json.loads((UI / f"{name}.json").read_text())
    assert not problems(ui), "\n".join(problems(ui))
    assert all(n["pos"][1] >= 30 for n in ui["nodes"])  # title bars on the canvas


def test_the_check_sees_the_old_layout_fail():
    """The layout these files had (every node 300 x 130, columns 330 apart, rows 200 apart)."""
    ui = json.loads((UI / "embedded_style.json").read_text())
    cells = mw.graphs()["embedded_style"]["layout"]
    for n in ui["nodes"]:
        col, row = cells[n["id"]]
        n["pos"], n["size"] = [40 + 330 * col, 40 + 200 * row], [300, 130]
    found = "\n".join(problems(ui))
    assert "node 6 (Negative prompt (empty = unconditional))" in found  # the title: 334 wide in DejaVu
    assert "node 8 (" in found  # the sampler's seven widgets are taller than 130
