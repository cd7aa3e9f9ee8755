"""Write the thumbnails of workflows/ (ComfyUI's template browser reads a pack's
`workflows` folder: NAME.json plus NAME.jpg as its thumbnail) and docs/icon.png (the registry icon).

    python tools/make_thumbnails.py --demo output/demo

- NAME.json: written by tools/make_workflows.py (the UI format the editor opens).
- NAME.jpg for an embedded_* workflow: its images from the main job's output folder
  (`python -m comfyui_lora_runtime demo --output DIR`), one per prompt, 2 x 2.
- NAME.jpg for a template_* workflow (it needs models the repo does not ship): a drawing
  of its graph from the node positions, sizes and titles saved in the workflow.
- docs/icon.png: the style adapter's four glyphs from the main job, 2 x 2, 256 px square.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "workflows"
ICON = ROOT / "docs" / "icon.png"
THUMB = 256
# embedded workflow -> the main job's run whose images show it (demo.RUNS keys)
RUN_OF = {"embedded_base": "base", "embedded_style": "style_auto", "embedded_style_diffusers": "style_diffusers",
          "embedded_distilled": "distilled_auto", "embedded_distilled_first_half": "distilled_half",
          # the stack of style (on) + distilled (off) gives embedded_style's images (tests/workflows)
          "embedded_style_stack": "style_auto"}


def names() -> list[str]:
    return sorted(p.stem for p in OUT.glob("*.json"))


def grid(files: list[str], size: int = THUMB) -> Image.Image:
    """The first image of each prompt (every second file: two images a prompt), 2 x 2."""
    picks = files[::2][:4]
    half = size // 2
    img = Image.new("RGB", (size, size), (0, 0, 0))
    for i, f in enumerate(picks):
        tile = Image.open(f).convert("RGB").resize((half, half), Image.NEAREST)
        img.paste(tile, ((i % 2) * half, (i // 2) * half))
    return img


def graph_drawing(ui: dict, size: int = THUMB) -> Image.Image:
    """Boxes and titles of the workflow's nodes and lines for its links, fitted into a square."""
    nodes = {n["id"]: n for n in ui.get("nodes", [])}
    x0 = min(n["pos"][0] for n in nodes.values())
    y0 = min(n["pos"][1] for n in nodes.values())
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes.values())
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes.values())
    pad = 8
    k = (size - 2 * pad) / max(x1 - x0, y1 - y0)
    x0 -= (size - 2 * pad - (x1 - x0) * k) / 2 / k  # centred
    y0 -= (size - 2 * pad - (y1 - y0) * k) / 2 / k
    img = Image.new("RGB", (size, size), (32, 32, 36))
    d = ImageDraw.Draw(img)

    def box(n):
        return (pad + (n["pos"][0] - x0) * k, pad + (n["pos"][1] - y0) * k,
                pad + (n["pos"][0] + n["size"][0] - x0) * k, pad + (n["pos"][1] + n["size"][1] - y0) * k)

    for link in ui.get("links", []):
        a, b = nodes.get(link[1]), nodes.get(link[3])
        if a and b:
            ba, bb = box(a), box(b)
            d.line((ba[2], (ba[1] + ba[3]) / 2, bb[0], (bb[1] + bb[3]) / 2), fill=(120, 160, 200), width=1)
    for n in nodes.values():
        ours = str(n.get("type", "")).startswith("LoraRuntime")
        d.rectangle(box(n), fill=(70, 60, 110) if ours else (60, 60, 66), outline=(150, 150, 160))
    return img


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo", required=True, metavar="DIR", help="the main job's output folder (decisions.json)")
    args = ap.parse_args(argv)
    decisions = {r["run"]: r for r in json.loads((Path(args.demo) / "decisions.json").read_text())}
    OUT.mkdir(exist_ok=True)
    for name in names():
        if name in RUN_OF:
            thumb = grid(decisions[RUN_OF[name]]["files"])
        else:
            thumb = graph_drawing(json.loads((OUT / f"{name}.json").read_text()))
        thumb.save(OUT / f"{name}.jpg", quality=90)
    grid(decisions["style_auto"]["files"]).save(ICON, optimize=True)
    print(f"wrote {len(names())} thumbnails to {OUT} and the icon {ICON}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
