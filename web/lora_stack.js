// Editor rows of the LoRA Stack node (comfyui-lora-runtime).
//
// The node's one real input is `rows`, a JSON list of
// {"on", "lora", "strength", "schedule", "branch", "blocks"} (see nodes/stack_node.py). Here
// that text widget is hidden and each row is drawn as ComfyUI's own widgets - on/off toggle,
// LoRA file, strength, schedule, branch, blocks and a remove button - with "+ Add LoRA" below.
// Every edit writes the JSON back into `rows`, so the saved workflow, the API prompt and
// a node without this extension all carry the same text. The row widgets are not
// serialized (the JSON is the one record) and are rebuilt from it when a workflow loads.
// A `rows` text that is not a JSON list stays visible as text, to be fixed by hand.
// Every frontend API use is guarded; nothing here may throw into ComfyUI.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { quietly } from "./lora_report_format.js";

export const NODE_CLASS = "LoraRuntimeStack";
const ROWS = "rows";
const ROW = Symbol("loraStackRow");
const PATCHED = Symbol("loraStackPatched");
const SAVED_SIZE = Symbol("loraStackSavedComputeSize");
const BRANCHES = ["both", "positive only", "negative only"];
let loraNames = [];
let branchChoices = BRANCHES;

/** `rows` text -> list of complete rows, or null when it is not a JSON list of objects. */
export function parseRows(text) {
  let raw;
  try {
    raw = String(text ?? "").trim() ? JSON.parse(String(text)) : [];
  } catch {
    return null;
  }
  if (!Array.isArray(raw) || raw.some((r) => !r || typeof r !== "object" || Array.isArray(r))) return null;
  return raw.map((r) => ({
    on: r.on !== false,
    lora: typeof r.lora === "string" ? r.lora : "",
    strength: Number.isFinite(Number(r.strength)) && r.strength !== null && r.strength !== "" ? Number(r.strength) : 1.0,
    schedule: typeof r.schedule === "string" ? r.schedule : "",
    branch: typeof r.branch === "string" ? r.branch : BRANCHES[0],
    blocks: typeof r.blocks === "string" ? r.blocks : "",
  }));
}

/** Rows -> the `rows` text the node reads (every key written, in a fixed order). */
export function serializeRows(rows) {
  return JSON.stringify(rows.map((r) => ({
    on: r.on !== false, lora: String(r.lora ?? ""), strength: Number(r.strength),
    schedule: String(r.schedule ?? ""), branch: String(r.branch ?? BRANCHES[0]), blocks: String(r.blocks ?? ""),
  })));
}

function rowsWidget(node) {
  return (node.widgets ?? []).find((w) => w?.name === ROWS && !w[ROW]);
}

function setRowsWidgetShown(w, shown) {
  w.hidden = !shown;
  // the Vue node renderer of frontend 1.49 reads options.hidden (not widget.hidden): without it the
  // rows JSON was shown there as a text box above the row widgets
  quietly(() => {
    if (!w.options || typeof w.options !== "object") w.options = {};
    w.options.hidden = !shown;
  });
  if (shown) {
    if (SAVED_SIZE in w) {
      w.computeSize = w[SAVED_SIZE];
      delete w[SAVED_SIZE];
    }
  } else if (!(SAVED_SIZE in w)) {
    w[SAVED_SIZE] = w.computeSize;
    w.computeSize = () => [0, -4];
  }
  if (w.element?.style) w.element.style.display = shown ? "" : "none";
}

function stateOf(node) {
  if (!node[ROW]) node[ROW] = { rows: [] };
  return node[ROW];
}

function write(node) {
  const w = rowsWidget(node);
  if (w) w.value = serializeRows(stateOf(node).rows);
  quietly(() => node.setDirtyCanvas?.(true, true));
}

function addRowWidget(node, tag, type, name, value, callback, options = {}) {
  if (typeof node.addWidget !== "function") return null;
  const w = node.addWidget(type, name, value, (v) => quietly(() => callback(v)), { ...options, serialize: false });
  if (!w) return null;
  w.serialize = false;
  w[ROW] = tag;
  // Frontends 1.49+ keep widget values in a store keyed by node and widget name, and a new widget of
  // a name still stored takes the stored value (1.49's removeWidget leaves it there): the row now at
  // this place must show its own value, not the one a removed row left under this name.
  if (value !== null && quietly(() => w.value) !== value) quietly(() => { w.value = value; });
  return w;
}

function clearRowWidgets(node) {
  if (!Array.isArray(node.widgets)) return;
  for (const w of node.widgets.filter((x) => x?.[ROW])) {
    // The core's removeWidget (it calls onRemove) also drops the widget's entry from the frontend's
    // widget store (1.58): a widget only filtered out of node.widgets stayed there, and the widget
    // of the same name made next (a row rebuilt after a remove) showed the removed row's value.
    if (typeof node.removeWidget === "function") quietly(() => node.removeWidget(w));
    else quietly(() => w.onRemove?.());
  }
  if (node.widgets.some((x) => x?.[ROW])) node.widgets = node.widgets.filter((x) => !x?.[ROW]);
}

/** [width, height] of the node: node.size is an Array, a typed array or (frontend 1.58) a Proxy over one. */
function sizeOf(node) {
  const w = Number(node?.size?.[0]);
  const h = Number(node?.size?.[1]);
  return Number.isFinite(w) && Number.isFinite(h) ? [w, h] : null;
}

/** The node as tall as its rows (after an add or a remove); `keep`: a loaded node only grows. */
function fit(node, keep = false) {
  quietly(() => {
    const want = node.computeSize?.();
    const size = sizeOf(node);
    if (want && size) node.setSize?.([Math.max(size[0], want[0]), keep ? Math.max(size[1], want[1]) : want[1]]);
  });
}

/** Redraw the row widgets from `rows` (after a load, an add or a remove); `loaded`: keep the saved size. */
export function rebuild(node, { loaded = false } = {}) {
  const w = rowsWidget(node);
  if (!w) return;
  const rows = parseRows(w.value);
  clearRowWidgets(node);
  if (rows === null) { // not a list of rows: leave the text to be fixed
    setRowsWidgetShown(w, true);
    fit(node, loaded);
    return;
  }
  setRowsWidgetShown(w, false);
  const st = stateOf(node);
  st.rows = rows;
  rows.forEach((row, i) => {
    const n = i + 1;
    const set = (key) => (v) => {
      st.rows[i][key] = key === "on" ? v !== false : key === "strength" ? Number(v) : v;
      write(node);
    };
    const names = loraNames.length ? loraNames : [row.lora];
    const choices = names.includes(row.lora) || !row.lora ? names : [row.lora, ...names];
    addRowWidget(node, { row: i, key: "on" }, "toggle", `LoRA ${n}`, row.on, set("on"), { on: "on", off: "off" });
    addRowWidget(node, { row: i, key: "lora" }, "combo", `${n} file`, row.lora, set("lora"), { values: choices });
    addRowWidget(node, { row: i, key: "strength" }, "number", `${n} strength`, row.strength, set("strength"),
      { min: -10, max: 10, step: 0.1, round: 0.01, precision: 2 });
    addRowWidget(node, { row: i, key: "schedule" }, "text", `${n} schedule`, row.schedule, set("schedule"));
    addRowWidget(node, { row: i, key: "branch" }, "combo", `${n} branch`, row.branch, set("branch"),
      { values: branchChoices });
    addRowWidget(node, { row: i, key: "blocks" }, "text", `${n} blocks`, row.blocks, set("blocks"));
    addRowWidget(node, { row: i, key: "remove" }, "button", `✕ remove LoRA ${n}`, null, () => removeRow(node, i));
  });
  addRowWidget(node, { row: -1, key: "add" }, "button", "+ Add LoRA", null, () => addRow(node));
  write(node);
  fit(node, loaded);
}

export function addRow(node) {
  const st = stateOf(node);
  const last = st.rows[st.rows.length - 1];
  st.rows.push({ on: true, lora: last?.lora ?? loraNames[0] ?? "", strength: 1.0, schedule: "", branch: BRANCHES[0],
    blocks: "" });
  write(node);
  rebuild(node);
}

export function removeRow(node, index) {
  const st = stateOf(node);
  st.rows.splice(index, 1);
  write(node);
  rebuild(node);
}

function chain(proto, name, after) {
  const original = proto[name];
  proto[name] = function (...args) {
    const r = typeof original === "function" ? original.apply(this, args) : undefined;
    quietly(() => after.apply(this, args));
    return r;
  };
}

function readChoices(nodeData) {
  const opts = nodeData?.input?.required?.[ROWS]?.[1];
  if (Array.isArray(opts?.lora_names)) loraNames = opts.lora_names.map(String);
  if (Array.isArray(opts?.branch_choices) && opts.branch_choices.length) branchChoices = opts.branch_choices.map(String);
}

function patchNodeType(nodeType, nodeData) {
  const proto = nodeType?.prototype;
  if (!proto || proto[PATCHED]) return;
  Object.defineProperty(proto, PATCHED, { value: true, enumerable: false });
  chain(proto, "onNodeCreated", function () {
    rebuild(this);
  });
  chain(proto, "onConfigure", function () {
    rebuild(this, { loaded: true }); // a saved workflow's size stands (grown only if its rows need more)
  });
}

quietly(() => app.registerExtension({
  name: "comfyui_lora_runtime.stack",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    quietly(() => {
      if ((nodeData?.name ?? nodeType?.comfyClass) !== NODE_CLASS) return;
      readChoices(nodeData);
      patchNodeType(nodeType, nodeData);
    });
  },
  async setup() {
    // A frontend that drops unknown input options: ask the server for the loras folder.
    if (loraNames.length) return;
    try {
      const res = await api?.fetchApi?.("/models/loras");
      const names = res?.ok ? await res.json() : null;
      if (Array.isArray(names)) loraNames = names.map(String);
    } catch {
      // no list: a row keeps the file it names
    }
  },
}));
