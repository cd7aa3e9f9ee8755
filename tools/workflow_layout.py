"""Node sizes and positions for the saved UI workflows, for the widest plausible font.

ComfyUI's editor (LiteGraph) draws node titles in 14 px and widget / slot text in 12 px
of "Arial", which the browser replaces by whatever sans font the machine has: Liberation
Sans (Arial's metrics) on many Linux machines, DejaVu Sans (about 16 % wider) where it is
the only one. When a workflow loads, every node is made at least as large as its content
measured in that font (``computeSize``: title, slot and widget labels, widget heights), so a
node saved just wide enough for Arial is drawn wider with DejaVu and can cover its
neighbour. Here every text is measured with ``text_width``, a per-character estimate that
is at least DejaVu Sans **Bold**'s advance for every printable ASCII character (wider than
any regular sans a browser falls back to), and the nodes are placed in a table whose
columns and rows are as wide and tall as their largest node plus a gap.

The editor's measures used here (frontend 1.27): title bar 30 high, the title drawn in the
node width less two title heights; a slot row 20; a widget 20 high plus 4; a multi-line
text box at least 50; a widget row's label and value inside 2 x (15 + 6 + 10) of margins and
arrows; 6 + 8 below the last widget.
"""
from __future__ import annotations

import math

TITLE_PX = 14          # LiteGraph.NODE_TEXT_SIZE: the title font
TEXT_PX = 12           # LiteGraph.NODE_SUBTEXT_SIZE: slot and widget labels and values
TITLE_H = 30           # LiteGraph.NODE_TITLE_HEIGHT
SLOT_H = 20            # LiteGraph.NODE_SLOT_HEIGHT
WIDGET_H = 20          # LiteGraph.NODE_WIDGET_HEIGHT
WIDGET_GAP = 4
MULTILINE_H = 80       # a text box (the editor's minimum is 50): three lines of a prompt show
WIDGET_MARGINS = 2 * (15 + 6 + 10) + 24  # margins and arrows both sides, and a gap between label and value
SLOT_MARGINS = 2 * SLOT_H + 5 + 20
MIN_WIDTH_WIDGETS = 210  # NODE_WIDTH 140 x 1.5 for a node with widgets
GAP_X, GAP_Y = 50, 40    # between columns / rows, besides the title bar above each node
ORIGIN = (40, 40)

# em widths, each at least DejaVu Sans Bold's advance for every character of its class
NARROW = set(" !'(),-./:;I[\\]`fijlrt|")
WIDE = set("mwMW@%&")
NARROW_EM, LOWER_EM, UPPER_EM, WIDE_EM, OTHER_EM = 0.50, 0.72, 0.85, 1.12, 1.15


def char_em(c: str) -> float:
    """A generous width of one character, in em (see the module docstring)."""
    if c in NARROW:
        return NARROW_EM
    if c in WIDE:
        return WIDE_EM
    if c.isascii() and (c.islower() or c.isdigit() or c in "_?$"):
        return LOWER_EM
    if c.isascii() and c.isprintable():
        return UPPER_EM
    return OTHER_EM


def text_width(text: str, px: float) -> float:
    """The width ``text`` may take at ``px`` pixels in any plausible sans font (an upper bound)."""
    return px * sum(char_em(c) for c in str(text))


def value_text(v) -> str:
    """A widget value as the editor shows it (numbers with two decimals at most, generously)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def _up(x: float, step: int = 10) -> int:
    return int(math.ceil(x / step) * step)


def node_size(title: str, sockets: list[str], outputs: list[str], widgets: list[tuple[str, str, bool]]) -> list[int]:
    """[width, height] of a node body that holds its content in any font.

    widgets: (label, shown value, multiline) per widget, in order."""
    width = text_width(title, TITLE_PX) + 2 * TITLE_H + 10  # the title is drawn in width - 2 x title height
    slots = max((text_width(s, TEXT_PX) for s in sockets), default=0) + \
        max((text_width(s, TEXT_PX) for s in outputs), default=0) + SLOT_MARGINS
    width = max(width, slots, MIN_WIDTH_WIDGETS if widgets else 140)
    height = max(len(sockets), len(outputs), 1) * SLOT_H
    for label, value, multiline in widgets:
        if multiline:
            height += MULTILINE_H + WIDGET_GAP
        else:
            width = max(width, text_width(label, TEXT_PX) + text_width(value, TEXT_PX) + WIDGET_MARGINS)
            height += WIDGET_H + WIDGET_GAP
    if widgets:
        height += 8
    return [_up(width), _up(height + 6)]


def table_positions(cells: dict, sizes: dict) -> dict:
    """{node: [x, y]} for nodes placed at (column, row) cells: each column as wide as its widest
    node plus GAP_X, each row as tall as its tallest node plus its title bar and GAP_Y."""
    cols = max(c for c, _ in cells.values()) + 1
    rows = max(r for _, r in cells.values()) + 1
    col_w = [max([sizes[n][0] for n, (c, _) in cells.items() if c == i], default=0) for i in range(cols)]
    row_h = [max([sizes[n][1] for n, (_, r) in cells.items() if r == j], default=0) for j in range(rows)]
    xs = [ORIGIN[0] + sum(w + GAP_X for w in col_w[:i]) for i in range(cols)]
    ys = [ORIGIN[1] + TITLE_H + sum(h + TITLE_H + GAP_Y for h in row_h[:j]) for j in range(rows)]
    return {n: [xs[c], ys[r]] for n, (c, r) in cells.items()}
