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


def _widget_specs(cls: type) -> tuple[dict, list[str]]:
    """(input specs by name, the widget names in widgets_values order) of a node class."""
    class_inputs = cls.INPUT_TYPES()
    specs = dict(class_inputs.get("required") or {})
    specs.update(class_inputs.get("optional") or {})
    return specs, [name for name, spec in specs.items() if _is_widget(spec)]


def _widget_layout(specs: Mapping, widget_names: list[str], values: list) -> tuple[list[tuple[str, int]], int]:
    """Where each widget's value sits in a list `widgets_values`: ([(name, index)], values used).

    One value per widget in order, plus the control_after_generate value saved after a
    seed widget. An index >= len(values) is where a missing value would go."""
    layout = []
    i = 0
    for name in widget_names:
        layout.append((name, i))
        i += 1
        if i < len(values) and _has_control_widget(name, specs[name]) \
                and values[i] in ("fixed", "increment", "decrement", "randomize"):
            i += 1  # the control_after_generate value
    return layout, min(i, len(values))


def _widget_default(spec: Any) -> Any:
    return (spec[1] or {}).get("default") if isinstance(spec, (tuple, list)) and len(spec) > 1 \
        and isinstance(spec[1], dict) else None


def _map_widgets(nid: str, node: Mapping, cls: type, inputs: dict) -> None:
    specs, widget_names = _widget_specs(cls)
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
    layout, used = _widget_layout(specs, widget_names, values)
    for name, i in layout:
        if i >= len(values):
            default = _widget_default(specs[name])
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
    if used < len(values):
        log.debug("node %s (%s): %d extra widget values ignored: %r", nid, node["type"],
                  len(values) - used, values[used:])


# ---------------------------------------------------------------------------
def set_widget_value(workflow: dict, node_id: str | int, input_name: str, value: Any,
                     node_classes: Mapping[str, type]) -> str | None:
    """Write `value` into a UI-format workflow (in place) as the widget `input_name` of
    node `node_id`, where `ui_to_api` reads it back: the same INPUT_TYPES, widget order
    and control_after_generate rule. So an override of the API prompt (e.g. the CLI's
    --set) can be made to the workflow saved beside it, and the two stay in agreement.

    A widget whose input is linked (converted to an input, fed by a PrimitiveNode or
    another node) is disconnected, as the API override replaces that link with the
    value. Returns a note saying so, else None. Raises WorkflowFormatError when the
    node is not in the workflow or `input_name` is not one of its widgets."""
    nid = str(node_id)
    node = next((n for n in workflow.get("nodes") or []
                 if isinstance(n, dict) and str(n.get("id")) == nid), None)
    if node is None:
        raise WorkflowFormatError(f"node {nid} is not in the UI workflow")
    cls = node_classes.get(node.get("type"))
    if cls is None:
        raise WorkflowFormatError(f"node {nid} ({node.get('type')}): unknown node type")
    specs, widget_names = _widget_specs(cls)
    if input_name not in widget_names:
        raise WorkflowFormatError(
            f"node {nid} ({node['type']}): {input_name!r} is not a widget (widgets: "
            f"{', '.join(widget_names) or 'none'}), so the UI workflow cannot hold a value for it")
    note = None
    for inp in node.get("inputs") or []:
        if inp.get("link") is not None and (inp.get("name") == input_name or
                                             (inp.get("widget") or {}).get("name") == input_name):
            origin = _disconnect(workflow, inp)
            note = f"disconnected the link from node {origin}" if origin is not None else "disconnected its link"
    values = node.get("widgets_values")
    if isinstance(values, Mapping):
        values[input_name] = value
    else:
        if values is None:
            values = node["widgets_values"] = []
        if not isinstance(values, list):
            raise WorkflowFormatError(f"node {nid} ({node['type']}): widgets_values must be a list, "
                                      f"got {type(values).__name__}")
        layout, _ = _widget_layout(specs, widget_names, values)
        index = dict(layout)[input_name]
        for name, i in layout:  # missing values before it: what ui_to_api uses for them
            if len(values) <= i < index:
                values.append(_widget_default(specs[name]))
        if index < len(values):
            values[index] = value
        else:
            values.append(value)
    check: dict[str, Any] = {}
    _map_widgets(nid, node, cls, check)
    if input_name not in check or check[input_name] != value:  # pragma: no cover - a layout bug
        raise WorkflowFormatError(f"node {nid} ({node['type']}): could not write widget {input_name!r}")
    return note


def _disconnect(workflow: dict, inp: dict) -> str | None:
    """Remove the link into input `inp` from the workflow; returns the origin node id."""
    link_id = inp.get("link")
    inp["link"] = None
    origin = None
    kept = []
    for link in workflow.get("links") or []:
        lid, o = ((link.get("id"), link.get("origin_id")) if isinstance(link, Mapping)
                  else (link[0], link[1]) if isinstance(link, (list, tuple)) and len(link) >= 2 else (None, None))
        if lid == link_id:
            origin = o
            continue
        kept.append(link)
    if "links" in workflow:
        workflow["links"] = kept
    for n in workflow.get("nodes") or []:
        if isinstance(n, dict) and (origin is None or str(n.get("id")) == str(origin)):
            for out in n.get("outputs") or []:
                if isinstance(out.get("links"), list) and link_id in out["links"]:
                    out["links"].remove(link_id)
    return None if origin is None else str(origin)
