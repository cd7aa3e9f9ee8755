// ComfyUI frontend extension of comfyui-lora-runtime: shows what the LoRA nodes
// report (adapter coverage, merge decision, fused kernels, timings) on the nodes.
//
// - The report a node receives (`executed` UI output of our nodes, or the
//   `lora_runtime.report` event the server sends for a stock sampler such as
//   ComfyUI's KSampler) is kept in node.properties, so it is saved with the
//   workflow and shown again when the workflow is loaded.
// - Classic LiteGraph canvas: it is rendered in a DOM widget (node.addDOMWidget,
//   type "lora_runtime_report", not serialized), which the canvas' DOM-widget
//   overlay lays over the node.
// - Layout (both renderers): the report never changes a node's width nor its
//   position; it only makes the node taller. A line wider than the node ends in an
//   ellipsis (its hover text has it whole). When the node below (any node whose
//   column overlaps this one's, starting lower) would be covered by the lines, the
//   report is one line instead - errors and warnings first, then the lines joined,
//   hover text with every line - and a click on it shows every line (the user's
//   choice: it may then cover that node), another click folds it again.
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
//   Frontend 1.49's (and 1.58's) Vue renderer shows DOM widgets inside the node: where
//   the DOM widget's element is inside the Vue node, that second element is left out
//   (the report would be shown twice).
// - A node added from the node list is made wide enough for its title, measured in the
//   font the canvas draws titles in (titleFont: Inter since frontend 1.49, Arial in 1.27),
//   once that web font has loaded.
// - Setting "LoraRuntime.ShowBadges" hides / shows it; a change of
//   Comfy.VueNodes.Enabled moves it between the two places.
// No canvas draw hooks are used. Every frontend API use is guarded; nothing here
// may throw into ComfyUI.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { collapsedSummary, formatPayload, hoverText, payloadFromOutput, quietly, summarize } from "./lora_report_format.js";

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
  LoraRuntimeStack: { kind: "coverage", property: "lora_coverage" }, // one coverage per row that is on
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
const GAP_PX = 8; // kept free above a node below (graph units)
const TITLE_PX = 30; // LiteGraph.NODE_TITLE_HEIGHT when the global is not there
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
        tight: false, // no room under the node for every line (decided by the renderer in use)
        expanded: false, // the user clicked the one-line badge: every line anyway
        rendered: { classic: null, vue: null }, // what each body shows ("full"/"collapsed" + items)
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
    // a block in the Vue node's body (a flex column), as wide as the body: its lines do not
    // count for the node's width (inline-size containment), so the node is never widened
    Object.assign(root.style, { margin: "0 16px", contain: "inline-size", minWidth: "0" });
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
  st.rendered.classic = null;
  renderBody(node, false);
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
  st.rendered.vue = null;
  renderBody(node, true);
  return st;
}

function collapsed(st) {
  return !!st && st.lines > 1 && !st.expanded && st.tight;
}

function shownLines(st) {
  if (!st || !st.lines) return 0;
  return collapsed(st) ? 1 : st.lines;
}

function reportHeight(lines) {
  return lines ? lines * LINE_PX + PAD_PX : 0;
}

function widgetHeight(node) {
  const st = node[STATE];
  if (!st || !st.lines || !badgesEnabled()) return 0;
  return reportHeight(shownLines(st)) + 2 * MARGIN_PX;
}

function makeRow(doc, item) {
  const row = doc.createElement("div");
  row.className = `lora-runtime-badge lora-runtime-${item.level}`;
  row.dataset.key = String(item.key);
  row.dataset.level = String(item.level);
  row.textContent = String(item.text ?? "");
  row.title = hoverText(item) || String(item.text ?? "");
  // one line each, never wider than the node: cut with an ellipsis, whole in the hover text
  Object.assign(row.style, {
    color: COLORS[item.level] || COLORS.info,
    fontWeight: item.level === "warn" || item.level === "error" ? "600" : "normal",
    whiteSpace: "nowrap",
    overflow: "hidden",
    textOverflow: "ellipsis",
  });
  return row;
}

function replaceRows(body, rows) {
  if (typeof body.replaceChildren === "function") body.replaceChildren(...rows);
  else {
    while (body.firstChild) body.removeChild(body.firstChild);
    for (const r of rows) body.appendChild(r);
  }
}

/** Every line, or the one-line badge when there is no room under the node (see the header). */
function renderBody(node, vue) {
  const st = node[STATE];
  const doc = globalThis.document;
  const body = vue ? st?.vueBody : st?.body;
  if (!st || !doc || !body) return;
  const fold = collapsed(st);
  const key = `${fold ? "collapsed" : "full"}:${st.tight ? "tight" : "room"}`;
  const slot = vue ? "vue" : "classic";
  if (st.rendered[slot] && st.rendered[slot].key === key && st.rendered[slot].items === st.items) return;
  st.rendered[slot] = { key, items: st.items };
  let rows;
  if (fold) {
    const summary = collapsedSummary(st.items);
    const row = makeRow(doc, { ...summary, text: `\u25B8 ${summary.text}` });
    row.title = `${summary.title}\n\n(click to show all ${summary.count} lines)`;
    row.dataset.collapsed = "true";
    rows = [row];
  } else {
    rows = (st.items || []).map((item) => makeRow(doc, item));
  }
  replaceRows(body, rows);
  // a click on the badge shows every line; on the lines, folds them again (only where room is short)
  const foldable = st.lines > 1 && st.tight;
  body.onclick = foldable ? () => quietly(() => toggleExpanded(node)) : null;
  body.style.cursor = foldable ? "pointer" : "";
  body.dataset.collapsed = fold ? "true" : "false";
}

function toggleExpanded(node) {
  const st = node[STATE];
  if (!st) return;
  st.expanded = !st.expanded;
  renderBody(node, false);
  renderBody(node, true);
  fitNode(node, false, { decide: false });
}

// ---------------------------------------------------------------- placement

function vueNodeHost(node) {
  return quietly(() => {
    const doc = globalThis.document;
    if (!doc || typeof doc.querySelector !== "function") return null;
    const current = app?.canvas?.graph ?? app?.graph;
    if (current && node.graph && node.graph !== current) return null; // not on screen
    const id = String(node.id).replace(/["\\]/g, "\\$&");
    const host = doc.querySelector(`[data-node-id="${id}"]`);
    return host && typeof host.querySelector === "function" ? host : null;
  }) ?? null;
}

function vueNodeBody(node) {
  return quietly(() => {
    const host = vueNodeHost(node);
    if (!host) return null;
    const id = String(node.id).replace(/["\\]/g, "\\$&");
    // the node's body (slots, widgets, content); absent while the node is collapsed
    return host.querySelector(`[data-testid="node-body-${id}"]`);
  }) ?? null;
}

function titleHeight() {
  const h = Number(globalThis.LiteGraph?.NODE_TITLE_HEIGHT);
  return Number.isFinite(h) && h > 0 ? h : TITLE_PX;
}

/**
 * The lowest y (graph units) the node may reach without covering a node below it: the title
 * of the nearest node whose column overlaps this one's and whose body starts lower, less a gap.
 * Infinity when there is none (or the graph cannot be read).
 */
function roomBelow(node) {
  return quietly(() => {
    const graph = node.graph ?? app?.graph;
    const raw = graph?._nodes ?? graph?.nodes;
    const nodes = Array.isArray(raw) ? raw : raw && typeof raw.values === "function" ? [...raw.values()] : [];
    const x0 = Number(node.pos?.[0]);
    const y0 = Number(node.pos?.[1]);
    const x1 = x0 + Number(node.size?.[0]);
    if (![x0, y0, x1].every(Number.isFinite)) return Infinity;
    const th = titleHeight();
    let limit = Infinity;
    for (const other of nodes) {
      if (!other || other === node || !other.pos || !other.size) continue;
      const ox0 = Number(other.pos[0]);
      const oy = Number(other.pos[1]);
      const ox1 = ox0 + Number(other.flags?.collapsed ? (other._collapsed_width || other.size[0]) : other.size[0]);
      if (![ox0, oy, ox1].every(Number.isFinite)) continue;
      if (ox0 >= x1 || ox1 <= x0 || oy <= y0) continue; // another column, or not below
      limit = Math.min(limit, oy - th - GAP_PX);
    }
    return limit;
  }) ?? Infinity;
}

/** Vue mode: would every line make the node reach into the node below? (measured in its element) */
function decideVueTight(node) {
  const st = node[STATE];
  if (!st) return false;
  const tight = quietly(() => {
    if (!st.lines || st.lines < 2) return false;
    const host = vueNodeHost(node);
    const hostHeight = Number(host?.offsetHeight) || 0;
    if (!hostHeight) return st.tight; // not drawn yet: keep what was decided
    // what of ours the node holds now (our element, or the DOM widget where the renderer shows it)
    let ours = 0;
    for (const el of [st.vueRoot, st.root]) {
      if (el && el.isConnected && host.contains?.(el)) ours += Number(el.offsetHeight) || 0;
    }
    // the Vue node's element starts at the title; sizes are graph units (the canvas scale is a transform)
    const bottom = Number(node.pos[1]) - titleHeight() + hostHeight - ours + reportHeight(st.lines);
    return bottom > roomBelow(node);
  });
  st.tight = !!tight;
  return st.tight;
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
  const host = vueNodeHost(node);
  if (host && st.root && st.root.isConnected && host.contains?.(st.root)) {
    // This renderer shows the DOM widget inside the Vue node itself (frontend 1.49): a second
    // element would show the report twice.
    detachVue(st);
    if (!st.widgetInVue) {
      st.widgetInVue = true;
      decideVueTight(node);
      renderBody(node, false);
    }
    return true;
  }
  st.widgetInVue = false;
  ensureVueElement(node);
  if (!st.vueRoot) return false;
  const display = badgesEnabled() ? "" : "none";
  if (st.vueBody.style.display !== display) st.vueBody.style.display = display;
  const target = vueNodeBody(node);
  if (target && st.vueRoot.parentNode !== target) {
    quietly(() => target.appendChild(st.vueRoot));
    decideVueTight(node);
    renderBody(node, true);
  }
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

/**
 * Classic canvas: the node keeps its width and position and grows downwards to its report;
 * when every line would reach into the node below, the report is one line (see the header).
 * decide: false keeps the current decision (a click on the badge).
 */
function fitNode(node, shrink, { decide = true } = {}) {
  quietly(() => {
    const st = node[STATE];
    if (vueNodesActive()) {
      // Vue nodes size themselves to their content (their width is not ours to change).
      if (decide && st) {
        decideVueTight(node);
        renderBody(node, true);
      }
      node.setDirtyCanvas?.(true, true);
      return;
    }
    if (typeof node.computeSize !== "function" || typeof node.setSize !== "function") return;
    const size = node.size || [0, 0];
    const y = Number(node.pos?.[1]);
    if (decide && st) {
      st.tight = false;
      if (!shrink && st.lines > 1 && Number.isFinite(y)) {
        const full = node.computeSize();
        st.tight = y + Math.max(size[1] || 0, full[1] || 0) > roomBelow(node);
      }
      renderBody(node, false);
    }
    const need = node.computeSize();
    let height = shrink ? need[1] : Math.max(size[1] || 0, need[1] || 0);
    if (!shrink && collapsed(st) && Number.isFinite(y)) {
      // folded for lack of room: not taller than the room (a node grown before folds back)
      height = Math.max(need[1] || 0, Math.min(size[1] || 0, roomBelow(node) - y));
    }
    const width = size[0]; // never wider: lines that do not fit end in an ellipsis
    if (height !== size[1]) node.setSize([width, height]);
    node.setDirtyCanvas?.(true, true);
  });
}

// ---------------------------------------------------------------- title room

const NODE_TEXT_SIZE = 14; // LiteGraph.NODE_TEXT_SIZE, for a frontend that defines no title font at all
const TITLE_EM = 0.85; // a generous average character width when no canvas can measure (wide fonts)
let measureCtx = null;

function fontString(value) {
  return typeof value === "string" && value.trim() ? value : undefined;
}

/**
 * The font the canvas draws the node's title in, as the running frontend defines it: the node's
 * titleFontStyle (LGraphNode: `${NODE_TEXT_SIZE}px ${NODE_FONT}`, Inter since frontend 1.49, Arial
 * in 1.27), else the canvas' title_text_font, else LiteGraph's NODE_TEXT_SIZE and NODE_FONT; Arial
 * only when the frontend names none.
 */
export function titleFont(node) {
  const own = fontString(quietly(() => node?.titleFontStyle));
  if (own) return own;
  const canvas = fontString(quietly(() => app?.canvas?.title_text_font));
  if (canvas) return canvas;
  return quietly(() => {
    const lg = globalThis.LiteGraph;
    const px = Number(lg?.NODE_TEXT_SIZE);
    const size = Number.isFinite(px) && px > 0 ? px : NODE_TEXT_SIZE;
    return `${size}px ${fontString(lg?.NODE_FONT) ?? "Arial"}`;
  }) ?? `${NODE_TEXT_SIZE}px Arial`;
}

/** The font size in px a CSS font string names (the estimate's unit). */
function fontPx(font) {
  const m = /(\d+(?:\.\d+)?)px/.exec(String(font));
  const px = m ? Number(m[1]) : NaN;
  return Number.isFinite(px) && px > 0 ? px : NODE_TEXT_SIZE;
}

/**
 * Whether the page can measure in `font` now. A web font the frontend ships (Inter) is measured in
 * the fallback font until it has loaded (about 8 % wider than Inter with DejaVu Sans): false then.
 * True where there is no font loading API (a font the system has, or no browser).
 */
function fontReady(font) {
  const fonts = globalThis.document?.fonts;
  if (!fonts || typeof fonts.check !== "function") return true;
  return quietly(() => fonts.check(font)) !== false;
}

/** The width of the node's title in its title font: measured on a canvas, else estimated generously. */
function titleTextWidth(node, font = titleFont(node)) {
  const title = String(node?.title ?? "");
  const measured = quietly(() => {
    if (!measureCtx) {
      const canvas = globalThis.document?.createElement?.("canvas");
      measureCtx = canvas && typeof canvas.getContext === "function" ? canvas.getContext("2d") : null;
    }
    if (!measureCtx || typeof measureCtx.measureText !== "function") return undefined;
    measureCtx.font = font;
    return measureCtx.measureText(title).width;
  });
  return Number.isFinite(measured) && measured > 0 ? measured : title.length * fontPx(font) * TITLE_EM;
}

/** [width, height] of the node: node.size is an Array, a typed array or (frontend 1.58) a Proxy over one. */
function sizeOf(node) {
  const w = Number(node?.size?.[0]);
  const h = Number(node?.size?.[1]);
  return Number.isFinite(w) && Number.isFinite(h) ? [w, h] : null;
}

/** The width a node needs for its whole title (the canvas draws it in the width less two title heights). */
export function titleRoomWidth(node, font = titleFont(node)) {
  return Math.ceil(titleTextWidth(node, font) + 2 * titleHeight() + 10);
}

/**
 * A node just added from the node list: wide enough for its whole title (the canvas draws the
 * title in the width less two title heights and cuts the rest; the core's first size reserves
 * less than that for a node without widgets, such as the report node). Not for loaded nodes:
 * a saved workflow's sizes are its own. When the title font is a web font that has not loaded
 * yet, the node is widened once it has (a width measured in the fallback would be too wide).
 */
function widenForTitle(node) {
  quietly(() => {
    if (typeof node.setSize !== "function" || !sizeOf(node)) return;
    const font = titleFont(node);
    const widen = () => quietly(() => {
      const size = sizeOf(node);
      if (!size || node[STATE]?.configured) return; // loaded meanwhile: its saved size stands
      const need = titleRoomWidth(node, font);
      if (size[0] < need) node.setSize([need, size[1]]);
    });
    if (fontReady(font)) {
      widen();
      return;
    }
    const loading = quietly(() => globalThis.document.fonts.load(font));
    if (loading && typeof loading.then === "function") loading.then(widen, widen);
    else widen();
  });
}

// ---------------------------------------------------------------- node updates

function show(node, spec, payload, { persist }) {
  const items = formatPayload(spec.kind, payload);
  if (persist) storePayload(node, spec, payload, items);
  const st = nodeState(node);
  st.items = items;
  st.lines = items.length;
  st.expanded = false; // a new report: the layout decides again
  if (!items.length) {
    renderBody(node, false);
    renderBody(node, true);
    applyVisibility(node);
    return;
  }
  // No elements while the badges are off: nothing to hide, nothing to lay out.
  if (!badgesEnabled() && !st.widget && !st.vueRoot) return;
  ensureWidget(node);
  applyVisibility(node);
  // what the layout did not draw again (the badges are off, no Vue node): the new lines
  renderBody(node, false);
  renderBody(node, true);
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
    widenForTitle(this); // a loaded workflow's configure sets its saved size afterwards
  });
  chain(proto, "onConfigure", function () {
    track(this);
    nodeState(this).configured = true; // a loaded node: its saved size stands (widenForTitle)
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
