"""Workflow JSON formats: API format and UI (litegraph) format.

API format (what ComfyUI's POST /prompt takes):
    {"5": {"class_type": "KSampler", "inputs": {"seed": 42, "model": ["1", 0], ...}}}

UI format (what "Save" writes and PNGs carry in their "workflow" chunk):
    {"nodes": [{"id": 5, "type": "KSampler", "mode": 0,
                "inputs": [{"name": "model", "type": "MODEL", "link": 3}, ...],
                "outputs": [{"name": "LATENT", "type": "LATENT", "links": [7]}],
                "widgets_values": [42, "fixed", 20, 8.0, "euler", "normal", 1.0]}, ...],
     "links": [[link_id, origin_id, origin_slot, target_id, target_slot, type], ...]}

`ui_to_api` does what the frontend's graph-to-prompt does for the nodes our
workflows use: widgets_values map positionally onto the widget inputs in
INPUT_TYPES order (required, then optional), skipping the extra
"control_after_generate" value that follows a seed widget; a link overrides a
widget's value; muted nodes (mode 2) are dropped; bypassed nodes (mode 4)
forward an input of the matching type to their consumers; Reroute nodes are
followed; PrimitiveNode values are inlined; Note nodes are dropped.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

log = logging.getLogger(__name__)

MODE_ALWAYS, MODE_NEVER, MODE_BYPASS = 0, 2, 4

# Frontend-only node types: never sent to the server.
VIRTUAL_NODE_TYPES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_INPUT_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_WIDGET_NAMES = {"seed", "noise_seed"}


class WorkflowFormatError(ValueError):
    """A workflow could not be read or converted; the message names the node."""


def detect_format(workflow: Any) -> str:
    """"api" or "ui"; raises WorkflowFormatError for anything else."""
    if isinstance(workflow, Mapping):
        if isinstance(workflow.get("nodes"), list) and "links" in workflow:
            return "ui"
        if workflow and all(isinstance(v, Mapping) and "class_type" in v for v in workflow.values()):
            return "api"
        if isinstance(workflow.get("prompt"), Mapping) and detect_format(workflow["prompt"]) == "api":
            return "api_envelope"  # a saved POST /prompt body: {"prompt": {...}, "extra_data": ...}
    raise WorkflowFormatError(
        "not a ComfyUI workflow: expected API format ({node_id: {class_type, inputs}}) or UI format "
        "({nodes: [...], links: [...]})")


def load_workflow(path: str | os.PathLike, node_classes: Mapping[str, type]
                  ) -> tuple[dict, dict | None]:
    """Read a workflow file in either format: (api_prompt, ui_workflow or None)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as ex:
        raise WorkflowFormatError(f"cannot read workflow {str(path)!r}: {ex}") from ex
    except ValueError as ex:
        raise WorkflowFormatError(f"workflow {str(path)!r} is not valid JSON: {ex}") from ex
    try:
        kind = detect_format(data)
    except WorkflowFormatError as ex:
        raise WorkflowFormatError(f"{path}: {ex}") from None
    if kind == "ui":
        return ui_to_api(data, node_classes), data
    if kind == "api_envelope":
        extra = data.get("extra_data", {}).get("extra_pnginfo", {}) if isinstance(data.get("extra_data"), dict) else {}
        return dict(data["prompt"]), extra.get("workflow")
    return dict(data), None


def ui_to_api(workflow: Mapping[str, Any], node_classes: Mapping[str, type]) -> dict:
    """Convert a UI-format workflow to an API-format prompt."""
    if detect_format(workflow) != "ui":
        raise WorkflowFormatError("ui_to_api expects a UI-format workflow ({nodes, links})")
    if workflow.get("definitions", {}).get("subgraphs") if isinstance(workflow.get("definitions"), dict) else False:
        log.warning("workflow defines subgraphs; nodes using them cannot be converted")
    nodes = {}
    for n in workflow["nodes"]:
        if not isinstance(n, Mapping) or "id" not in n or "type" not in n:
            raise WorkflowFormatError(f"UI workflow node without id/type: {str(n)[:200]}")
        nodes[str(n["id"])] = n
    links = _parse_links(workflow.get("links") or [])
    graph = _Graph(nodes, links)

    prompt: dict[str, dict] = {}
    for nid, n in nodes.items():
        ntype = n["type"]
        mode = n.get("mode", MODE_ALWAYS)
        if ntype in VIRTUAL_NODE_TYPES or mode in (MODE_NEVER, MODE_BYPASS):
            continue
        cls = node_classes.get(ntype)
        if cls is None:
            raise WorkflowFormatError(f"node {nid} ({ntype}): unknown node type; it is neither a core "
                                      f"node of the bundled host nor one of this pack's nodes")
        inputs: dict[str, Any] = {}
        _map_widgets(nid, n, cls, inputs)
        for slot, inp in enumerate(n.get("inputs") or []):
            link_id = inp.get("link")
            if link_id is None:
                continue
            source = graph.resolve(nid, slot, link_id, inp.get("type"))
            name = inp.get("name")
            if source is None:
                inputs.pop(name, None)  # from a muted node / dead end: as if unconnected
            elif source[0] == "value":
                inputs[name] = source[1]
            else:
                inputs[name] = [source[1], source[2]]
        prompt[nid] = {"class_type": ntype, "inputs": inputs,
                       "_meta": {"title": n.get("title") or ntype}}
    return prompt


# ---------------------------------------------------------------------------
def _parse_links(raw: list) -> dict[int, tuple[str, int, str, int, Any]]:
    """link id -> (origin_id, origin_slot, target_id, target_slot, type)."""
    out = {}
    for link in raw:
        if isinstance(link, Mapping):  # newer serialisation
            lid, o, os_, t, ts, typ = (link.get(k) for k in
                                       ("id", "origin_id", "origin_slot", "target_id", "target_slot", "type"))
        elif isinstance(link, (list, tuple)) and len(link) >= 5:
            lid, o, os_, t, ts = link[:5]
            typ = link[5] if len(link) > 5 else None
        else:
            raise WorkflowFormatError(f"malformed link entry {link!r}")
        out[int(lid)] = (str(o), int(os_), str(t), int(ts), typ)
    return out


class _Graph:
    def __init__(self, nodes: dict[str, Mapping], links: dict):
        self.nodes = nodes
        self.links = links

    def resolve(self, target_id: str, target_slot: int, link_id: Any, want_type: Any, _depth: int = 0):
        """Where an input really comes from: ("link", node_id, slot), ("value", v), or None."""
        if _depth > len(self.nodes) + 1:
            raise WorkflowFormatError(f"node {target_id}: reroute/bypass chain loops")
        if link_id not in self.links:
            raise WorkflowFormatError(f"node {target_id} ({self.nodes[target_id]['type']}): input "
                                      f"{target_slot} refers to missing link {link_id}")
        origin_id, origin_slot, _, _, _ = self.links[link_id]
        origin = self.nodes.get(origin_id)
        if origin is None:
            raise WorkflowFormatError(f"node {target_id} ({self.nodes[target_id]['type']}): link "
                                      f"{link_id} comes from missing node {origin_id}")
        otype, mode = origin["type"], origin.get("mode", MODE_ALWAYS)
        if otype == "Reroute":
            upstream = _input_link(origin, 0)
            if upstream is None:
                return None
            return self.resolve(origin_id, 0, upstream, want_type, _depth + 1)
        if otype == "PrimitiveNode":
            values = origin.get("widgets_values") or []
            if not values:
                raise WorkflowFormatError(f"node {origin_id} (PrimitiveNode) has no value")
            return ("value", values[0])
        if otype in ("Note", "MarkdownNote"):
            raise WorkflowFormatError(f"node {target_id}: linked to a {otype} node {origin_id}")
        if mode == MODE_NEVER:
            return None
        if mode == MODE_BYPASS:
            # As the frontend: the input at the same index as the used output if its
            # type matches, else the first input of the matching type.
            ins = origin.get("inputs") or []
            order = ([origin_slot] if origin_slot < len(ins) else []) + list(range(len(ins)))
            for i in order:
                if ins[i].get("type") == want_type and ins[i].get("link") is not None:
                    return self.resolve(origin_id, i, ins[i]["link"], want_type, _depth + 1)
            return None
        return ("link", origin_id, origin_slot)


def _input_link(node: Mapping, slot: int):
    ins = node.get("inputs") or []
    return ins[slot].get("link") if slot < len(ins) else None


def _is_widget(spec: Any) -> bool:
    typ = spec[0] if isinstance(spec, (tuple, list)) and spec else spec
    opts = spec[1] if isinstance(spec, (tuple, list)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
    if opts.get("forceInput"):
        return False
    return isinstance(typ, (list, tuple)) or typ in WIDGET_INPUT_TYPES


def _has_control_widget(name: str, spec: Any) -> bool:
    typ = spec[0] if isinstance(spec, (tuple, list)) and spec else spec
    opts = spec[1] if isinstance(spec, (tuple, list)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
    flag = opts.get("control_after_generate")
    if flag is not None:
        return bool(flag)
    return typ == "INT" and name in SEED_WIDGET_NAMES


def _map_widgets(nid: str, node: Mapping, cls: type, inputs: dict) -> None:
    class_inputs = cls.INPUT_TYPES()
    specs = dict(class_inputs.get("required") or {})
    specs.update(class_inputs.get("optional") or {})
    widget_names = [name for name, spec in specs.items() if _is_widget(spec)]
    values = node.get("widgets_values")
    if values is None:
        values = []
    if isinstance(values, Mapping):  # some nodes serialise widgets by name
        for name in widget_names:
            if name in values:
                inputs[name] = values[name]
        return
    if not isinstance(values, list):
        raise WorkflowFormatError(f"node {nid} ({node['type']}): widgets_values must be a list, "
                                  f"got {type(values).__name__}")
    linked = {inp.get("name") for inp in node.get("inputs") or [] if inp.get("link") is not None}
    i = 0
    for name in widget_names:
        if i >= len(values):
            default = (specs[name][1] or {}).get("default") if len(specs[name]) > 1 else None
            if name in linked:
                continue
            if default is None:
                raise WorkflowFormatError(
                    f"node {nid} ({node['type']}): widgets_values has {len(values)} values, none left "
                    f"for widget {name!r} (widgets in order: {widget_names}); was the workflow saved "
                    f"with another version of this node?")
            log.warning("node %s (%s): no saved value for widget %r, using its default %r",
                        nid, node["type"], name, default)
            inputs[name] = default
            continue
        inputs[name] = values[i]
        i += 1
        if _has_control_widget(name, specs[name]) and i < len(values) \
                and values[i] in ("fixed", "increment", "decrement", "randomize"):
            i += 1  # the control_after_generate value
    if i < len(values):
        log.debug("node %s (%s): %d extra widget values ignored: %r", nid, node["type"],
                  len(values) - i, values[i:])
