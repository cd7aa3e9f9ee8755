// ComfyUI frontend extension of comfyui-lora-runtime: shows what the LoRA nodes
// report (adapter coverage, merge decision, fused kernels, timings) on the nodes.
//
// - The report a node receives (`executed` UI output) is kept in node.properties,
//   so it is saved with the workflow and shown again when the workflow is loaded.
// - It is rendered in a DOM widget (node.addDOMWidget): the classic canvas lays the
//   element over the canvas, the Vue node renderer ("Nodes 2.0") puts the same
//   element inside the node. No canvas draw hooks are used.
// - Setting "LoraRuntime.ShowBadges" hides / shows it.
// Every frontend API use is guarded; nothing here may throw into ComfyUI.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { formatPayload, payloadFromOutput, summarize } from "./lora_report_format.js";

const SETTING_ID = "LoraRuntime.ShowBadges";
const WIDGET_NAME = "lora_runtime_report";
const WIDGET_TYPE = "lora_runtime_report"; // a type no core widget renderer claims
const SUMMARY_PROPERTY = "lora_runtime_summary";
// node type -> [UI output kind, property the payload is kept in]
const NODE_TYPES = {
  LoraRuntimeSampler: { kind: "report", property: "lora_runtime_report" },
  LoraRuntimeLoadAdapter: { kind: "coverage", property: "lora_coverage" },
};

const LINE_PX = 16;
const PAD_PX = 4;
const MARGIN_PX = 10; // room for the DOM widget's margin in the classic canvas
const MIN_NODE_WIDTH = 280;
const COLORS = {
  ok: "var(--lora-runtime-ok, #5fb760)",
  warn: "var(--lora-runtime-warn, #e0a030)",
  error: "var(--lora-runtime-error, #e05555)",
  info: "var(--descrip-text, #999)",
};

const STATE = Symbol("loraRuntime");
const PATCHED = Symbol("loraRuntimePatched");
const trackedNodes = new Set();
let showBadges = null; // null until a setting value is known

function quietly(fn) {
  try {
    return fn();
  } catch {
    return undefined;
  }
}

function readSetting(id) {
  return quietly(() => {
    const store = app?.extensionManager?.setting;
    if (store && typeof store.get === "function") return store.get(id);
    const legacy = app?.ui?.settings;
    if (legacy && typeof legacy.getSettingValue === "function") return legacy.getSettingValue(id);
    return undefined;
  });
}

function badgesEnabled() {
  if (typeof showBadges === "boolean") return showBadges;
  const v = readSetting(SETTING_ID);
  return v === undefined || v === null ? true : v !== false;
}

function vueNodesActive() {
  return readSetting("Comfy.VueNodes.Enabled") === true;
}

function nodeState(node) {
  if (!node[STATE]) {
    Object.defineProperty(node, STATE, {
      value: { widget: null, root: null, body: null, lines: 0, lastOutput: null },
      enumerable: false,
    });
  }
  return node[STATE];
}

// ---------------------------------------------------------------- persistence

function storePayload(node, spec, payload, items) {
  quietly(() => {
    if (!node.properties || typeof node.properties !== "object") node.properties = {};
    // Strings, so the property panels of both renderers can show them as text.
    node.properties[spec.property] = JSON.stringify(payload ?? null);
    node.properties[SUMMARY_PROPERTY] = summarize(items);
  });
}

function loadPayload(node, spec) {
  return quietly(() => {
    const raw = node.properties?.[spec.property];
    if (raw === undefined || raw === null || raw === "") return undefined;
    return typeof raw === "string" ? JSON.parse(raw) : raw;
  });
}

// ---------------------------------------------------------------- DOM widget

function ensureWidget(node) {
  const st = nodeState(node);
  if (st.widget) return st;
  const doc = globalThis.document;
  if (!doc || typeof node.addDOMWidget !== "function") return st;

  const root = doc.createElement("div");
  root.className = "lora-runtime-report";
  Object.assign(root.style, {
    boxSizing: "border-box",
    width: "100%",
    height: "100%",
    overflow: "hidden",
    font: `11px/${LINE_PX}px sans-serif`,
    pointerEvents: "auto",
  });
  const body = doc.createElement("div");
  Object.assign(body.style, {
    padding: `${PAD_PX / 2}px 6px`,
    borderRadius: "4px",
    background: "var(--comfy-input-bg, rgba(0, 0, 0, 0.25))",
  });
  root.appendChild(body);

  const widget = quietly(() => node.addDOMWidget(WIDGET_NAME, WIDGET_TYPE, root, {
    serialize: false, // not a prompt input, not part of widgets_values
    hideOnZoom: true,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => widgetHeight(node),
    getMaxHeight: () => widgetHeight(node),
  }));
  if (!widget) return st;
  quietly(() => {
    widget.serialize = false;
  });
  st.widget = widget;
  st.root = root;
  st.body = body;
  return st;
}

function widgetHeight(node) {
  const st = node[STATE];
  if (!st || !st.lines || !badgesEnabled()) return 0;
  return st.lines * LINE_PX + PAD_PX + 2 * MARGIN_PX;
}

function renderLines(st, items) {
  const doc = globalThis.document;
  const body = st.body;
  if (!doc || !body) return;
  const rows = items.map((item) => {
    const row = doc.createElement("div");
    row.className = `lora-runtime-badge lora-runtime-${item.level}`;
    row.dataset.key = String(item.key);
    row.dataset.level = String(item.level);
    row.textContent = String(item.text ?? "");
    row.title = String(item.title || item.text || "");
    Object.assign(row.style, {
      color: COLORS[item.level] || COLORS.info,
      whiteSpace: "nowrap",
      overflow: "hidden",
      textOverflow: "ellipsis",
      fontWeight: item.level === "warn" || item.level === "error" ? "600" : "normal",
    });
    return row;
  });
  if (typeof body.replaceChildren === "function") body.replaceChildren(...rows);
  else {
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const r of rows) body.appendChild(r);
  }
}

function applyVisibility(node) {
  const st = node[STATE];
  if (!st || !st.body) return;
  const visible = badgesEnabled() && st.lines > 0;
  st.body.style.display = visible ? "" : "none";
  fitNode(node, !visible);
}

function fitNode(node, shrink) {
  quietly(() => {
    if (vueNodesActive()) {
      // Vue nodes size themselves to their content.
      node.setDirtyCanvas?.(true, true);
      return;
    }
    if (typeof node.computeSize !== "function" || typeof node.setSize !== "function") return;
    const need = node.computeSize();
    const size = node.size || [0, 0];
    const width = Math.max(size[0] || 0, need[0] || 0, MIN_NODE_WIDTH);
    const height = shrink ? need[1] : Math.max(size[1] || 0, need[1] || 0);
    if (width !== size[0] || height !== size[1]) node.setSize([width, height]);
    node.setDirtyCanvas?.(true, true);
  });
}

// ---------------------------------------------------------------- node updates

function show(node, spec, payload, { persist }) {
  const items = formatPayload(spec.kind, payload);
  if (persist) storePayload(node, spec, payload, items);
  if (!items.length) {
    const st = node[STATE];
    if (st) st.lines = 0;
    applyVisibility(node);
    return;
  }
  // No widget while the badges are off: nothing to hide, nothing to lay out.
  if (!badgesEnabled() && !node[STATE]?.widget) return;
  const st = ensureWidget(node);
  if (!st.widget) return;
  st.lines = items.length;
  renderLines(st, items);
  applyVisibility(node);
}

function onOutput(node, spec, output) {
  const st = nodeState(node);
  if (output && st.lastOutput === output) return; // delivered twice (hook + event)
  st.lastOutput = output || null;
  const got = payloadFromOutput(output);
  if (!got || got.kind !== spec.kind) return;
  show(node, spec, got.payload, { persist: true });
}

function restore(node, spec) {
  const payload = loadPayload(node, spec);
  if (payload === undefined) return;
  show(node, spec, payload, { persist: false });
}

function refreshAll() {
  for (const node of trackedNodes) {
    quietly(() => {
      const spec = NODE_TYPES[node[STATE]?.type];
      if (!spec) return;
      if (node[STATE].widget) applyVisibility(node);
      else if (badgesEnabled()) restore(node, spec);
    });
  }
}

function chain(proto, name, after) {
  const original = proto[name];
  proto[name] = function (...args) {
    const r = typeof original === "function" ? original.apply(this, args) : undefined;
    quietly(() => after.apply(this, args));
    return r;
  };
}

function patchNodeType(nodeType, comfyClass) {
  const spec = NODE_TYPES[comfyClass];
  const proto = nodeType?.prototype;
  if (!spec || !proto || proto[PATCHED]) return;
  Object.defineProperty(proto, PATCHED, { value: true, enumerable: false });

  const track = (node) => {
    nodeState(node).type = comfyClass;
    trackedNodes.add(node);
  };

  chain(proto, "onNodeCreated", function () {
    track(this);
  });
  chain(proto, "onConfigure", function () {
    track(this);
    restore(this, spec);
  });
  chain(proto, "onExecuted", function (output) {
    track(this);
    onOutput(this, spec, output);
  });
  chain(proto, "onRemoved", function () {
    trackedNodes.delete(this);
  });
}

// The core calls node.onExecuted for every `executed` message; this listener only
// covers frontends that do not (same output object: handled once).
function onExecutedEvent(event) {
  quietly(() => {
    const detail = event?.detail;
    const output = detail?.output;
    if (!output || typeof output !== "object") return;
    if (!("lora_report" in output) && !("lora_coverage" in output)) return;
    const id = detail.display_node ?? detail.node;
    const graph = app?.graph;
    if (id === undefined || id === null || !graph || typeof graph.getNodeById !== "function") return;
    const node = graph.getNodeById(id) ?? graph.getNodeById(Number(id));
    const spec = node && NODE_TYPES[node[STATE]?.type];
    if (!spec) return;
    // Let the core's own listener (which calls onExecuted) go first.
    setTimeout(() => quietly(() => onOutput(node, spec, output)), 0);
  });
}

quietly(() => app.registerExtension({
  name: "comfyui_lora_runtime.report",
  settings: [
    {
      id: SETTING_ID,
      name: "LoRA Runtime: show runtime report on nodes",
      type: "boolean",
      defaultValue: true,
      tooltip: "Adapter coverage, merge decision, fused kernels and timings on the LoRA nodes after a run.",
      onChange: (value) => {
        showBadges = value !== false;
        refreshAll();
      },
    },
  ],
  async beforeRegisterNodeDef(nodeType, nodeData) {
    quietly(() => patchNodeType(nodeType, nodeData?.name ?? nodeType?.comfyClass));
  },
  async setup() {
    quietly(() => {
      if (api && typeof api.addEventListener === "function") api.addEventListener("executed", onExecutedEvent);
    });
  },
}));
