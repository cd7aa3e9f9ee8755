// The LoRA Stack editor rows (web/lora_stack.js) against stub ComfyUI modules (see
// tests/testkit/web/harness.mjs): rows added, edited and removed through ComfyUI's own widgets, the
// JSON written into the node's `rows` input (the one serialized value), rows rebuilt
// from a saved workflow, a text that is not a list left visible; never a throw or a log.
import assert from "node:assert/strict";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { afterEach, beforeEach, test } from "node:test";

import { installFakeDocument, tree } from "../testkit/web/harness.mjs";

const urls = tree();
installFakeDocument();
const { app } = await import(urls.app);
const stack = await import(pathToFileURL(join(urls.root, "extensions", "comfyui-lora-runtime", "lora_stack.js")).href);
const ext = app.extensions.find((e) => e.name === "comfyui_lora_runtime.stack");

const consoleCalls = [];
const saved = {};
beforeEach(() => {
  for (const k of ["log", "info", "warn", "error", "debug"]) {
    saved[k] = console[k];
    console[k] = (...a) => consoleCalls.push([k, a]);
  }
});
afterEach(() => {
  Object.assign(console, saved);
  assert.deepEqual(consoleCalls, [], "the extension must not log");
});

/** LGraphNode subset: widgets made by addWidget, the `rows` and `unmatched_keys` inputs. */
function makeStackClass() {
  class FakeStack {
    constructor() {
      this.size = [300, 80];
      this.widgets = [
        { name: "rows", type: "customtext", value: "[]", element: { style: {} }, computeSize: () => [300, 60] },
        { name: "unmatched_keys", type: "combo", value: "error" },
      ];
    }
    addWidget(type, name, value, callback, options) {
      const w = { type, name, value, callback, options };
      this.widgets.push(w);
      return w;
    }
    computeSize() {
      return [200, 30 + 24 * this.widgets.filter((w) => !w.hidden).length];
    }
    setSize(s) {
      this.size = [...s];
    }
    setDirtyCanvas() {}
  }
  return FakeStack;
}

const NODE_DATA = {
  name: "LoraRuntimeStack",
  input: { required: { model: ["MODEL"], rows: ["STRING", { default: "[]", multiline: true,
    lora_names: ["style.safetensors", "sub/second.safetensors"],
    branch_choices: ["both", "positive only", "negative only"] }] } },
};
const Stack = makeStackClass();
await ext.beforeRegisterNodeDef(Stack, NODE_DATA, app);

function create() {
  const node = new Stack();
  node.onNodeCreated?.();
  return node;
}
const rowsOf = (node) => JSON.parse(node.widgets[0].value);
const widget = (node, name) => node.widgets.find((w) => w.name === name);
const click = (node, name) => widget(node, name).callback(null);

test("a new node: the rows text hidden, one + Add LoRA button, no row", () => {
  const node = create();
  assert.equal(node.widgets[0].hidden, true);
  assert.equal(node.widgets[0].options.hidden, true); // what frontend 1.49's Vue nodes read
  assert.deepEqual(node.widgets[0].computeSize(), [0, -4]);
  assert.equal(node.widgets[0].element.style.display, "none");
  assert.deepEqual(node.widgets.slice(2).map((w) => w.name), ["+ Add LoRA"]);
  assert.deepEqual(rowsOf(node), []);
});

test("add, edit and remove rows: the JSON the node reads follows every edit", () => {
  const node = create();
  click(node, "+ Add LoRA");
  assert.deepEqual(rowsOf(node), [{ on: true, lora: "style.safetensors", strength: 1, schedule: "", branch: "both", blocks: "" }]);
  assert.deepEqual(node.widgets.slice(2).map((w) => [w.type, w.name]), [
    ["toggle", "LoRA 1"], ["combo", "1 file"], ["number", "1 strength"], ["text", "1 schedule"],
    ["combo", "1 branch"], ["text", "1 blocks"], ["button", "✕ remove LoRA 1"], ["button", "+ Add LoRA"]]);
  assert.deepEqual(widget(node, "1 file").options.values, ["style.safetensors", "sub/second.safetensors"]);
  assert.deepEqual(widget(node, "1 branch").options.values, ["both", "positive only", "negative only"]);
  click(node, "+ Add LoRA");
  widget(node, "2 file").callback("sub/second.safetensors");
  widget(node, "2 strength").callback(-0.5);
  widget(node, "2 schedule").callback("0:1, 0.5:0");
  widget(node, "2 branch").callback("positive only");
  widget(node, "1 blocks").callback("0-9: 0.5, !cross_attn");
  widget(node, "LoRA 1").callback(false);
  assert.deepEqual(rowsOf(node), [
    { on: false, lora: "style.safetensors", strength: 1, schedule: "", branch: "both",
      blocks: "0-9: 0.5, !cross_attn" },
    { on: true, lora: "sub/second.safetensors", strength: -0.5, schedule: "0:1, 0.5:0", branch: "positive only", blocks: "" }]);
  click(node, "✕ remove LoRA 1");
  assert.deepEqual(rowsOf(node), [
    { on: true, lora: "sub/second.safetensors", strength: -0.5, schedule: "0:1, 0.5:0", branch: "positive only", blocks: "" }]);
  assert.equal(widget(node, "1 file").value, "sub/second.safetensors"); // renumbered
  assert.equal(widget(node, "2 file"), undefined);
  assert.ok(node.size[1] >= node.computeSize()[1]); // the node grew / shrank with its rows
});

test("row widgets are not serialized: the rows text stays the one saved value, first", () => {
  const node = create();
  click(node, "+ Add LoRA");
  for (const w of node.widgets.slice(2)) {
    assert.equal(w.serialize, false, w.name);
    assert.equal(w.options.serialize, false, w.name);
  }
  assert.deepEqual(node.widgets.slice(0, 2).map((w) => w.name), ["rows", "unmatched_keys"]);
});

test("a loaded workflow: rows rebuilt from the saved text", () => {
  const node = create();
  node.widgets[0].value = JSON.stringify([{ lora: "sub/second.safetensors", strength: 0.25, on: false },
    { lora: "gone.safetensors" }]);
  node.onConfigure?.({});
  assert.equal(widget(node, "LoRA 1").value, false);
  assert.equal(widget(node, "1 strength").value, 0.25);
  assert.equal(widget(node, "2 file").value, "gone.safetensors"); // a file not in the folder is kept, shown first
  assert.deepEqual(widget(node, "2 file").options.values, ["gone.safetensors", "style.safetensors",
    "sub/second.safetensors"]);
  assert.deepEqual(rowsOf(node)[1], { on: true, lora: "gone.safetensors", strength: 1, schedule: "", branch: "both", blocks: "" });
});

test("a rows text that is not a list of rows stays visible as text, with no row widgets", () => {
  const node = create();
  click(node, "+ Add LoRA");
  node.widgets[0].value = "{not json";
  node.onConfigure?.({});
  assert.equal(node.widgets[0].hidden, false);
  assert.equal(node.widgets[0].options.hidden, false);
  assert.deepEqual(node.widgets[0].computeSize(), [300, 60]);
  assert.equal(node.widgets[0].element.style.display, "");
  assert.equal(node.widgets.length, 2);
  assert.equal(node.widgets[0].value, "{not json"); // not overwritten
  assert.equal(stack.parseRows('[{"lora": "a"}, 3]'), null);
  assert.equal(stack.parseRows('{"lora": "a"}'), null);
});

test("serializeRows writes the keys nodes/stack_node.py reads, in a fixed order", () => {
  const text = stack.serializeRows([{ lora: "a.safetensors", strength: "0.5" }]);
  assert.equal(text, '[{"on":true,"lora":"a.safetensors","strength":0.5,"schedule":"","branch":"both","blocks":""}]');
  assert.deepEqual(stack.parseRows(text), JSON.parse(text));
});

test("other node types are not touched", async () => {
  const Other = makeStackClass();
  await ext.beforeRegisterNodeDef(Other, { name: "LoraRuntimeLoadAdapter" }, app);
  const node = new Other();
  node.onNodeCreated?.();
  assert.equal(node.widgets.length, 2);
  assert.equal(node.widgets[0].hidden, undefined);
});

/**
 * Frontend 1.58's node, as far as the rows touch it: node.size is a Proxy over a Float64Array (no
 * Array, no typed array to Array.isArray / ArrayBuffer.isView), and a widget's value lives in a
 * store keyed by the widget's name that only removeWidget clears: a widget of a name still in the
 * store takes the stored value, not the one it was made with.
 */
function makeStoreStackClass({ removeClears = true } = {}) {
  class StoreStack extends makeStackClass() {
    constructor() {
      super();
      this.store = new Map();
      const buf = new Float64Array([300, 80]);
      this.sizeProxy = new Proxy(buf, {});
      Object.defineProperty(this, "size", {
        get: () => this.sizeProxy,
        set: (v) => { buf[0] = v[0]; buf[1] = v[1]; },
      });
    }
    addWidget(type, name, value, callback, options) {
      const stored = this.store.get(name);
      const w = super.addWidget(type, name, stored ? stored.value : value, callback, options);
      if (!stored) this.store.set(name, { value });
      const entry = this.store.get(name);
      Object.defineProperty(w, "value", { get: () => entry.value, set: (v) => { entry.value = v; }, configurable: true });
      return w;
    }
    removeWidget(w) {
      const i = this.widgets.indexOf(w);
      if (i === -1) throw new Error("Widget not found on this node");
      w.onRemove?.();
      if (removeClears) this.store.delete(w.name); // 1.58; 1.49 leaves the entry in its store
      this.widgets.splice(i, 1);
    }
  }
  return StoreStack;
}

for (const [frontend, removeClears] of [["1.58", true], ["1.49", false]]) test(`frontend ${frontend} (widget store, Proxy size): a removed row's values do not stay on the renumbered row`, async () => {
  const StoreStack = makeStoreStackClass({ removeClears });
  await ext.beforeRegisterNodeDef(StoreStack, NODE_DATA, app);
  const node = new StoreStack();
  node.onNodeCreated?.();
  assert.ok(!Array.isArray(node.size) && !ArrayBuffer.isView(node.size), "the stub's size is a Proxy");
  click(node, "+ Add LoRA");
  click(node, "+ Add LoRA");
  widget(node, "2 file").callback("sub/second.safetensors");
  widget(node, "2 file").value = "sub/second.safetensors";
  widget(node, "LoRA 2").callback(false);
  widget(node, "LoRA 2").value = false;
  const tall = node.size[1];
  click(node, "✕ remove LoRA 1");
  // the row that was second is now first, and its widgets show it (not the removed row's values)
  assert.deepEqual(rowsOf(node), [{ on: false, lora: "sub/second.safetensors", strength: 1, schedule: "",
    branch: "both", blocks: "" }]);
  assert.equal(widget(node, "LoRA 1").value, false);
  assert.equal(widget(node, "1 file").value, "sub/second.safetensors");
  assert.equal(widget(node, "2 file"), undefined);
  if (removeClears) assert.ok(![...node.store.keys()].some((k) => k.startsWith("2 ")), [...node.store.keys()]);
  // the node follows its rows through the Proxy size: shorter by one row
  assert.equal(node.size[1], node.computeSize()[1]);
  assert.ok(node.size[1] < tall, [tall, node.size[1]]);
  assert.equal(node.size[0], 300);
});

test("a loaded node keeps its saved size (grown only where its rows need more); an add or a remove fits it", () => {
  const node = create();
  node.widgets[0].value = JSON.stringify([{ lora: "style.safetensors" }]);
  node.size = [420, 500]; // the workflow's size, taller than the rows need
  node.onConfigure?.({});
  assert.deepEqual(node.size, [420, 500]);
  const low = create();
  low.widgets[0].value = JSON.stringify([{ lora: "style.safetensors" }, { lora: "style.safetensors" }]);
  low.size = [420, 100];
  low.onConfigure?.({});
  assert.deepEqual(low.size, [420, low.computeSize()[1]]);
  click(node, "✕ remove LoRA 1");
  assert.deepEqual(node.size, [420, node.computeSize()[1]]);
});
