// ComfyUI frontend extension of comfyui-lora-runtime: shows what the LoRA nodes
// report (adapter coverage, merge decision, fused kernels, timings) on the nodes.
//
// - The report a node receives (`executed` UI output of our nodes, or the
//   `lora_runtime.report` event the server sends for a stock sampler such as
//   ComfyUI's KSampler) is kept in node.properties, so it is saved with the
//   workflow and shown again when the workflow is loaded.
// - Classic LiteGraph canvas: it is rendered in a DOM widget (node.addDOMWidget,
//   type "lora_runtime_report", not serialized), which the canvas' DOM-widget
//   overlay lays over the node; the node is widened so the lines fit (up to
//   MAX_NODE_WIDTH; longer lines end in an ellipsis, the tooltip has the text).
// - Vue node renderer ("Nodes 2.0", setting Comfy.VueNodes.Enabled): that renderer
//   draws none of this. It only renders widgets whose type is in its own widget
//   registry, and in frontend 1.27 it copies a node's widget list when the node is
//   added / the graph is configured / the mode is switched on, re-renders a node's
//   widgets only when their number changes, and does not show later value changes
//   of its text widgets; the DOM-widget overlay is off. So a report that arrives
//   after a run could not be shown (or hidden) through a widget there. Instead the
//   same lines are rendered into a second element that is placed inside the Vue
//   node's own element (its body, under the widgets), and put back there when the
//   renderer re-creates the node's DOM. Nothing is added to node.widgets for it.
// - Setting "LoraRuntime.ShowBadges" hides / shows it; a change of
//   Comfy.VueNodes.Enabled moves it between the two places.
// No canvas draw hooks are used. Every frontend API use is guarded; nothing here
// may throw into ComfyUI.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { formatPayload, payloadFromOutput, summarize } from "./lora_report_format.js";

const SETTING_ID = "LoraRuntime.ShowBadges";
const VUE_SETTING_ID = "Comfy.VueNodes.Enabled";
const WIDGET_NAME = "lora_runtime_report";
const WIDGET_TYPE = "lora_runtime_report"; // a type no core widget renderer claims
const SUMMARY_PROPERTY = "lora_runtime_summary";
// node type -> [UI output kind, property the payload is kept in]
const NODE_TYPES = {
  LoraRuntimeSampler: { kind: "report", property: "lora_runtime_report" },
  LoraRuntimeReport: { kind: "report", property: "lora_runtime_report" },
  LoraRuntimeLoadAdapter: { kind: "coverage", property: "lora_coverage" },
};
// Any other node that sampled a MODEL carrying adapters (ComfyUI's KSampler, another
// pack's sampler) gets the report the server sends as a `lora_runtime.report` event.
const REPORT_EVENT = "lora_runtime.report";
const STOCK_SPEC = { kind: "report", property: "lora_runtime_report" };

function specOf(node) {
  const st = node?.[STATE];
  return NODE_TYPES[st?.type] ?? (st?.stock ? STOCK_SPEC : undefined);
}

const LINE_PX = 16;
const PAD_PX = 4;
const SIDE_PAD_PX = 6; // left / right padding of the report body
const MARGIN_PX = 10; // room for the DOM widget's margin in the classic canvas
const MIN_NODE_WIDTH = 280;
const MAX_NODE_WIDTH = 480; // the classic node is widened to fit its lines up to this
const VUE_MAX_WIDTH_PX = 440; // the report inside a Vue node wraps beyond this
const VUE_CHECK_MS = 250; // how often a Vue-mode report is checked to be in its node
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
let vueNodesOverride = null; // the value a Comfy.VueNodes.Enabled change announced
let vueTimer = null;

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
  // The change event comes before the store holds the new value.
  if (typeof vueNodesOverride === "boolean") return vueNodesOverride;
  return readSetting(VUE_SETTING_ID) === true;
}

function nodeState(node) {
  if (!node[STATE]) {
    Object.defineProperty(node, STATE, {
      value: {
        widget: null, root: null, body: null, vueRoot: null, vueBody: null, items: [], lines: 0,
        lastOutput: null,
      },
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

// ---------------------------------------------------------------- elements

function makeReportElement(doc, vue) {
  const root = doc.createElement("div");
  root.className = vue ? "lora-runtime-report lora-runtime-vue" : "lora-runtime-report";
  Object.assign(root.style, {
    boxSizing: "border-box",
    overflow: "hidden",
    font: `11px/${LINE_PX}px sans-serif`,
    pointerEvents: "auto",
  });
  if (vue) {
    // a block in the Vue node's body (a flex column); the node sizes itself to it
    Object.assign(root.style, { margin: "0 16px", maxWidth: `${VUE_MAX_WIDTH_PX}px` });
  } else {
    Object.assign(root.style, { width: "100%", height: "100%" });
  }
  const body = doc.createElement("div");
  Object.assign(body.style, {
    padding: `${PAD_PX / 2}px ${SIDE_PAD_PX}px`,
    borderRadius: "4px",
    background: "var(--comfy-input-bg, rgba(0, 0, 0, 0.25))",
  });
  root.appendChild(body);
  return { root, body };
}

// The classic canvas' DOM widget.
function ensureWidget(node) {
  const st = nodeState(node);
  if (st.widget) return st;
  const doc = globalThis.document;
  if (!doc || typeof node.addDOMWidget !== "function") return st;

  const { root, body } = makeReportElement(doc, false);
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
  renderLines(st.body, st.items, false);
  return st;
}

// The element shown inside a Vue node (no widget: see the header comment).
function ensureVueElement(node) {
  const st = nodeState(node);
  if (st.vueRoot) return st;
  const doc = globalThis.document;
  if (!doc) return st;
  const { root, body } = makeReportElement(doc, true);
  st.vueRoot = root;
  st.vueBody = body;
  renderLines(st.vueBody, st.items, true);
  return st;
}

function widgetHeight(node) {
  const st = node[STATE];
  if (!st || !st.lines || !badgesEnabled()) return 0;
  return st.lines * LINE_PX + PAD_PX + 2 * MARGIN_PX;
}

function makeRow(doc, item, wrap) {
  const row = doc.createElement("div");
  row.className = `lora-runtime-badge lora-runtime-${item.level}`;
  row.dataset.key = String(item.key);
  row.dataset.level = String(item.level);
  row.textContent = String(item.text ?? "");
  row.title = String(item.title || item.text || "");
  Object.assign(row.style, {
    color: COLORS[item.level] || COLORS.info,
    fontWeight: item.level === "warn" || item.level === "error" ? "600" : "normal",
  });
  if (wrap) Object.assign(row.style, { whiteSpace: "normal", overflowWrap: "anywhere" });
  else Object.assign(row.style, { whiteSpace: "nowrap", overflow: "hidden", textOverflow: "ellipsis" });
  return row;
}

function renderLines(body, items, wrap) {
  const doc = globalThis.document;
  if (!doc || !body) return;
  const rows = (items || []).map((item) => makeRow(doc, item, wrap));
  if (typeof body.replaceChildren === "function") body.replaceChildren(...rows);
  else {
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const r of rows) body.appendChild(r);
  }
}

/** Width in px the widest line needs on one line (0 when it cannot be measured). */
function measureLines(items) {
  return quietly(() => {
    const doc = globalThis.document;
    const host = doc?.body;
    if (!doc || !host || typeof host.appendChild !== "function" || !items?.length) return 0;
    const probe = doc.createElement("div");
    Object.assign(probe.style, {
      position: "absolute",
      left: "-10000px",
      top: "0",
      visibility: "hidden",
      width: "max-content",
      font: `11px/${LINE_PX}px sans-serif`,
    });
    const rows = items.map((item) => makeRow(doc, item, false));
    for (const r of rows) probe.appendChild(r);
    host.appendChild(probe);
    let widest = 0;
    try {
      for (const r of rows) widest = Math.max(widest, Number(r.scrollWidth) || 0);
    } finally {
      if (typeof probe.remove === "function") probe.remove();
      else host.removeChild?.(probe);
    }
    return widest;
  }) || 0;
}

/** Node width at which no line is cut, capped at MAX_NODE_WIDTH. */
function fittingWidth(st) {
  const text = measureLines(st.items);
  if (!text) return 0;
  // DOM widget margin and body padding on both sides, and a pixel or two of rounding
  return Math.min(MAX_NODE_WIDTH, Math.ceil(text) + 2 * MARGIN_PX + 2 * SIDE_PAD_PX + 2);
}

// ---------------------------------------------------------------- placement

function vueNodeBody(node) {
  return quietly(() => {
    const doc = globalThis.document;
    if (!doc || typeof doc.querySelector !== "function") return null;
    const current = app?.canvas?.graph ?? app?.graph;
    if (current && node.graph && node.graph !== current) return null; // not on screen
    const id = String(node.id).replace(/["\\]/g, "\\$&");
    const host = doc.querySelector(`[data-node-id="${id}"]`);
    if (!host || typeof host.querySelector !== "function") return null;
    // the node's body (slots, widgets, content); absent while the node is collapsed
    return host.querySelector(`[data-testid="node-body-${id}"]`);
  }) ?? null;
}

function detachVue(st) {
  quietly(() => {
    const r = st?.vueRoot;
    if (r && r.parentNode) {
      if (typeof r.remove === "function") r.remove();
      else r.parentNode.removeChild(r);
    }
  });
}

/** Vue mode: keep the report element inside the node's element. Returns true while needed. */
function placeVue(node) {
  const st = node[STATE];
  if (!st) return false;
  if (!vueNodesActive() || !st.lines) {
    detachVue(st);
    return false;
  }
  ensureVueElement(node);
  if (!st.vueRoot) return false;
  const display = badgesEnabled() ? "" : "none";
  if (st.vueBody.style.display !== display) st.vueBody.style.display = display;
  const target = vueNodeBody(node);
  if (target && st.vueRoot.parentNode !== target) quietly(() => target.appendChild(st.vueRoot));
  return true;
}

function checkVueNodes() {
  let needed = false;
  for (const node of trackedNodes) {
    if (quietly(() => placeVue(node))) needed = true;
  }
  if (!needed) stopVueWatch();
}

function startVueWatch() {
  if (vueTimer !== null || typeof setInterval !== "function") return;
  vueTimer = setInterval(checkVueNodes, VUE_CHECK_MS);
  quietly(() => vueTimer?.unref?.()); // never keeps a non-browser host (tests) alive
}

function stopVueWatch() {
  if (vueTimer === null) return;
  clearInterval(vueTimer);
  vueTimer = null;
}

function applyVisibility(node) {
  const st = node[STATE];
  if (!st) return;
  if (placeVue(node)) startVueWatch();
  if (!st.body) return;
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
    const fit = shrink ? 0 : fittingWidth(node[STATE]);
    const width = Math.max(size[0] || 0, need[0] || 0, MIN_NODE_WIDTH, fit);
    const height = shrink ? need[1] : Math.max(size[1] || 0, need[1] || 0);
    if (width !== size[0] || height !== size[1]) node.setSize([width, height]);
    node.setDirtyCanvas?.(true, true);
  });
}

// ---------------------------------------------------------------- node updates

function show(node, spec, payload, { persist }) {
  const items = formatPayload(spec.kind, payload);
  if (persist) storePayload(node, spec, payload, items);
  const st = nodeState(node);
  st.items = items;
  st.lines = items.length;
  if (!items.length) {
    renderLines(st.body, items, false);
    renderLines(st.vueBody, items, true);
    applyVisibility(node);
    return;
  }
  // No elements while the badges are off: nothing to hide, nothing to lay out.
  if (!badgesEnabled() && !st.widget && !st.vueRoot) return;
  ensureWidget(node);
  renderLines(st.body, items, false);
  renderLines(st.vueBody, items, true);
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
      const st = node[STATE];
      const spec = specOf(node);
      if (!spec) return;
      if (st.widget || st.vueRoot) applyVisibility(node);
      else if (badgesEnabled()) restore(node, spec);
    });
  }
}

function onVueSettingChange(event) {
  quietly(() => {
    const value = event?.detail?.value;
    vueNodesOverride = typeof value === "boolean" ? value : null;
    refreshAll();
    // once the store holds the value and the renderer has switched
    setTimeout(() => quietly(() => {
      vueNodesOverride = null;
      refreshAll();
    }), 0);
  });
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
    detachVue(this[STATE]);
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
    const node = findNode(detail.display_node ?? detail.node);
    const spec = node && NODE_TYPES[node[STATE]?.type];
    if (!spec) return;
    // Let the core's own listener (which calls onExecuted) go first.
    setTimeout(() => quietly(() => onOutput(node, spec, output)), 0);
  });
}

function trackStock(node) {
  const st = nodeState(node);
  st.stock = true;
  trackedNodes.add(node);
}

function findNode(id) {
  const graph = app?.graph;
  if (id === undefined || id === null || !graph || typeof graph.getNodeById !== "function") return undefined;
  return graph.getNodeById(id) ?? graph.getNodeById(Number(id)) ?? undefined;
}

// A stock sampler's run: the server sends the report for the node that executed.
function onReportEvent(event) {
  quietly(() => {
    const detail = event?.detail;
    const report = detail?.report;
    if (!report || typeof report !== "object") return;
    const node = findNode(detail.display_node ?? detail.node);
    if (!node) return;
    if (NODE_TYPES[node[STATE]?.type] || NODE_TYPES[node.comfyClass] || NODE_TYPES[node.type]) return; // ours: `executed` brings it
    trackStock(node);
    onOutput(node, STOCK_SPEC, { lora_report: [report] });
  });
}

// A loaded workflow: a stock node that kept a report in its properties shows it again.
function onLoadedGraphNode(node) {
  quietly(() => {
    if (NODE_TYPES[node?.[STATE]?.type] || NODE_TYPES[node?.comfyClass] || NODE_TYPES[node?.type]) return;
    const raw = node?.properties?.[STOCK_SPEC.property];
    if (raw === undefined || raw === null || raw === "") return;
    trackStock(node);
    restore(node, STOCK_SPEC);
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
  loadedGraphNode(node) {
    onLoadedGraphNode(node);
  },
  async setup() {
    quietly(() => {
      if (api && typeof api.addEventListener === "function") {
        api.addEventListener("executed", onExecutedEvent);
        api.addEventListener(REPORT_EVENT, onReportEvent);
      }
    });
    quietly(() => {
      // the settings dialog dispatches "<id>.change" for every setting change
      const settings = app?.ui?.settings;
      if (settings && typeof settings.addEventListener === "function") {
        settings.addEventListener(`${VUE_SETTING_ID}.change`, onVueSettingChange);
      }
    });
    quietly(() => refreshAll());
  },
}));
