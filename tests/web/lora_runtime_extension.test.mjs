// Smoke + behaviour test of web/lora_runtime.js against stub ComfyUI modules
// (see tests/testkit/web/harness.mjs): it must parse as an ES module, register the extension,
// and keep/render/hide the report without ever throwing or logging.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { copyFileSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterEach, beforeEach, test } from "node:test";

import { WEB_DIR, addVueNode, fullReport, installFakeDocument, makeNodeClass, tree } from "../testkit/web/harness.mjs";

const urls = tree();
installFakeDocument();
const { app } = await import(urls.app);
const { api } = await import(urls.api);
const fmt = await import(urls.format);
const extModule = await import(urls.extension);
const ext = app.extensions.find((e) => e.name === "comfyui_lora_runtime.report");
await ext.setup?.();

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

const setting = (value) => {
  app.settingValues["LoraRuntime.ShowBadges"] = value;
  ext.settings[0].onChange(value, !value);
};

async function register(name, opts) {
  const Cls = makeNodeClass(opts);
  await ext.beforeRegisterNodeDef(Cls, { name }, app);
  return Cls;
}

function create(Cls) {
  const node = new Cls();
  node.onNodeCreated?.();
  return node;
}

const rows = (node) => node.widgets[0].element.children[0].children;

test("every web/*.js file passes `node --check` as an ES module", () => {
  const dir = mkdtempSync(join(tmpdir(), "lora-runtime-check-"));
  for (const f of ["lora_runtime.js", "lora_report_format.js"]) {
    const copy = join(dir, f.replace(/\.js$/, ".mjs"));
    copyFileSync(join(WEB_DIR, f), copy);
    execFileSync(process.execPath, ["--check", copy]);
  }
  rmSync(dir, { recursive: true, force: true });
});

test("registers the extension and its setting", () => {
  assert.ok(ext, "extension registered");
  assert.equal(typeof ext.beforeRegisterNodeDef, "function");
  const s = ext.settings.find((x) => x.id === "LoraRuntime.ShowBadges");
  assert.equal(s.name, "LoRA Runtime: show runtime report on nodes");
  assert.equal(s.type, "boolean");
  assert.equal(s.defaultValue, true);
});

test("sampler: report kept in properties and rendered in a DOM widget", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  assert.equal(node.widgets.length, 0, "no widget before a report");
  const report = fullReport();
  node.onExecuted({ lora_report: [report] });

  assert.deepEqual(JSON.parse(node.properties.lora_runtime_report), report);
  assert.match(node.properties.lora_runtime_summary, /^dynamic — a merge would lose 78 %/);
  assert.equal(node.addDOMWidgetCalls.length, 1);
  const [name, type, , options] = node.addDOMWidgetCalls[0];
  assert.equal(name, "lora_runtime_report");
  assert.equal(type, "lora_runtime_report");
  assert.equal(options.serialize, false);
  assert.equal(node.widgets[0].serialize, false);

  const expected = fmt.formatReport(report);
  const r = rows(node);
  assert.equal(r.length, expected.length);
  r.forEach((row, i) => {
    assert.equal(row.textContent, expected[i].text);
    assert.equal(row.dataset.level, expected[i].level);
    assert.ok(row.title.length > 0);
    assert.ok(row.style.color);
  });
  const warning = r.find((row) => row.dataset.key === "coverage-warning");
  assert.ok(warning, "visible warning line for partial coverage");
  assert.match(warning.title, /text_encoder\.layers\.0\.q_proj/);
  assert.equal(options.getMinHeight(), options.getMaxHeight());
  assert.ok(options.getMinHeight() >= expected.length * 16);
  assert.ok(node.size[1] >= node.computeSize()[1], "node grew to fit the report");

  node.onExecuted({ lora_report: [{ ...report, decision: null, adapters: [] }] });
  assert.equal(node.widgets.length, 1, "the widget is reused");
  assert.equal(rows(node)[0].textContent, "no adapter applied");
});

test("setting off hides the report and collapses it; on shows it again", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  node.onExecuted({ lora_report: [fullReport()] });
  const body = node.widgets[0].element.children[0];
  const tall = node.size[1];
  setting(false);
  assert.equal(body.style.display, "none");
  assert.equal(node.widgets[0].options.getMinHeight(), 0);
  assert.ok(node.size[1] < tall, "node shrank");
  node.onExecuted({ lora_report: [fullReport()] });
  assert.equal(body.style.display, "none", "stays hidden while the setting is off");
  setting(true);
  assert.equal(body.style.display, "");
  assert.ok(node.widgets[0].options.getMinHeight() > 0);

  // nodes that got a report while off get their widget when it is turned on
  setting(false);
  const late = create(Sampler);
  late.onExecuted({ lora_report: [fullReport()] });
  assert.equal(late.widgets.length, 0);
  assert.ok(late.properties.lora_runtime_report);
  setting(true);
  assert.equal(late.widgets.length, 1);
});

test("a saved workflow shows its report again on load (onConfigure)", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const first = create(Sampler);
  first.onExecuted({ lora_report: [fullReport()] });
  const loaded = new Sampler();
  loaded.properties = JSON.parse(JSON.stringify(first.properties));
  loaded.onConfigure?.({ properties: loaded.properties });
  assert.equal(rows(loaded).length, rows(first).length);
  // a hand-edited, broken property does not throw
  const broken = new Sampler();
  broken.properties = { lora_runtime_report: "{not json" };
  assert.doesNotThrow(() => broken.onConfigure?.({}));
  assert.equal(broken.widgets.length, 0);
});

test("loader: coverage with a visible warning line", async () => {
  setting(true);
  const Loader = await register("LoraRuntimeLoadAdapter");
  const node = create(Loader);
  node.onExecuted({ lora_coverage: [{ adapter: "p.safetensors", format: "kohya", matched: 0, file_layers: 10,
    model_linears: 40, unmatched: 10, unmatched_examples: ["k1 (why)"] }] });
  const r = rows(node);
  assert.equal(r.length, 2);
  assert.equal(r[0].dataset.level, "error");
  assert.match(r[0].title, /k1 \(why\)/);
  assert.equal(r[1].dataset.key, "coverage-warning");
  assert.ok(node.properties.lora_coverage);
  // an output of the other kind is ignored
  node.onExecuted({ lora_report: [fullReport()] });
  assert.equal(rows(node).length, 2);
});

test("other node types are left alone; mode/tier nodes get nothing", async () => {
  for (const name of ["KSampler", "LoraRuntimeMergeMode", "LoraRuntimeQualityTier"]) {
    const Cls = makeNodeClass();
    const before = Object.getOwnPropertyNames(Cls.prototype).sort();
    await ext.beforeRegisterNodeDef(Cls, { name }, app);
    assert.deepEqual(Object.getOwnPropertyNames(Cls.prototype).sort(), before, name);
  }
});

test("existing prototype hooks are chained, and patching twice is harmless", async () => {
  const Cls = makeNodeClass();
  const seen = [];
  Cls.prototype.onExecuted = function (o) {
    seen.push(o);
    return "original";
  };
  await ext.beforeRegisterNodeDef(Cls, { name: "LoraRuntimeSampler" }, app);
  await ext.beforeRegisterNodeDef(Cls, { name: "LoraRuntimeSampler" }, app);
  const node = create(Cls);
  const out = { lora_report: [fullReport()] };
  assert.equal(node.onExecuted(out), "original");
  assert.equal(seen.length, 1);
  assert.equal(node.addDOMWidgetCalls.length, 1);
});

test("no addDOMWidget, no document, garbage outputs: nothing throws", async () => {
  setting(true);
  const Bare = await register("LoraRuntimeSampler", { withDomWidgets: false });
  const bare = create(Bare);
  bare.onExecuted({ lora_report: [fullReport()] });
  assert.ok(bare.properties.lora_runtime_report, "still kept in properties");

  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  for (const out of [undefined, null, "x", 3, [], {}, { lora_report: "garbage" }, { lora_report: [null] },
    { lora_report: [{ adapters: "x", decision: 5 }] }, { lora_coverage: null }]) {
    assert.doesNotThrow(() => node.onExecuted(out));
  }
  const doc = globalThis.document;
  delete globalThis.document;
  try {
    const nodoc = create(Sampler);
    assert.doesNotThrow(() => nodoc.onExecuted({ lora_report: [fullReport()] }));
    assert.equal(nodoc.widgets.length, 0);
  } finally {
    globalThis.document = doc;
  }
  const thrower = create(Sampler);
  thrower.addDOMWidget = () => {
    throw new Error("renderer refused");
  };
  assert.doesNotThrow(() => thrower.onExecuted({ lora_report: [fullReport()] }));
  thrower.onRemoved?.();
});

test("api `executed` fallback renders once; the same output via onExecuted is not rendered twice", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  app.graph.nodes.set(String(node.id), node);
  const output = { lora_report: [fullReport()] };
  // frontend that does not call onExecuted: the event alone renders it
  api.dispatchEvent(new CustomEvent("executed", { detail: { node: String(node.id), output } }));
  await new Promise((r) => setTimeout(r, 5));
  assert.equal(node.widgets.length, 1);
  const body = node.widgets[0].element.children[0];
  const renders = body.replaceCount;
  // core calls onExecuted with the same object, then the event fires: one render
  const output2 = { lora_report: [fullReport()] };
  node.onExecuted(output2);
  api.dispatchEvent(new CustomEvent("executed", { detail: { node: String(node.id), display_node: String(node.id),
    output: output2 } }));
  await new Promise((r) => setTimeout(r, 5));
  assert.equal(body.replaceCount, renders + 1);
  // unrelated events are ignored
  api.dispatchEvent(new CustomEvent("executed", { detail: { node: "999", output: { images: [] } } }));
  api.dispatchEvent(new CustomEvent("executed", { detail: null }));
  await new Promise((r) => setTimeout(r, 5));
  app.graph.nodes.delete(String(node.id));
});

const vueMode = (value) => {
  // the settings dialog announces the change before the store holds the value
  app.ui.settings.dispatchEvent(new CustomEvent("Comfy.VueNodes.Enabled.change", { detail: { value } }));
  app.settingValues["Comfy.VueNodes.Enabled"] = value;
};
const vueRoot = (body) => body.children.find((c) => String(c.className).includes("lora-runtime-vue"));

test("classic canvas: the node keeps its width and position; a long line ends in an ellipsis", async () => {
  setting(true);
  const Loader = await register("LoraRuntimeLoadAdapter");
  const node = create(Loader);
  node.pos = [370, 40];
  const adapter = "a_long_adapter_name_for_the_width_test.safetensors";
  node.onExecuted({ lora_coverage: [{ adapter, format: "kohya", matched: 40, file_layers: 40 }] });
  const line = rows(node)[0];
  // the layer count first, the file name cut in the middle: a line cut at the node's edge keeps the count
  assert.equal(line.textContent, "40/40 layers · a_long_adapter…he_width_test (kohya)");
  assert.ok(line.title.includes(adapter), "the hover text has the whole file name");
  assert.ok(line.scrollWidth > node.size[0], "the line is wider than the node");
  assert.equal(node.size[0], 200, "not widened");
  assert.deepEqual(node.pos, [370, 40], "not moved");
  assert.ok(node.size[1] >= node.computeSize()[1], "grown downwards to the report");
  assert.equal(line.style.whiteSpace, "nowrap");
  assert.equal(line.style.overflow, "hidden");
  assert.equal(line.style.textOverflow, "ellipsis", "a line wider than the node ends in an ellipsis");
  assert.ok(line.title.startsWith(line.textContent), "the hover text has the whole line");
  assert.equal(document.body.children.length, 0, "nothing left in the page");
  // a node the user made wider or narrower keeps its width
  for (const w of [600, 150]) {
    node.setSize([w, node.size[1]]);
    node.onExecuted({ lora_coverage: [{ adapter, format: "kohya", matched: 40, file_layers: 40 }] });
    assert.equal(node.size[0], w);
  }
  const huge = create(Loader);
  huge.onExecuted({ lora_coverage: [{ adapter: `${"x".repeat(200)}.safetensors`, matched: 1, file_layers: 1 }] });
  assert.equal(huge.size[0], 200);
});

test("classic canvas: no room under the node for every line -> one-line badge, click shows all", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  const Other = makeNodeClass();
  const below = new Other();
  const beside = new Other();
  node.pos = [0, 0];
  below.pos = [100, 200]; // overlaps the node's column, starts lower
  beside.pos = [250, 10]; // another column: never in the way
  node.graph = { nodes: [node, below, beside] };
  const limit = below.pos[1] - 30 - 8; // its title, and a gap
  const report = fullReport();
  const items = fmt.formatReport(report);
  node.onExecuted({ lora_report: [report] });
  const full = 100 + items.length * 16 + 4 + 20; // what every line would need (harness computeSize)
  assert.ok(full > limit, "the test needs a report taller than the room");

  let r = rows(node);
  assert.equal(r.length, 1, "one line");
  assert.equal(r[0].dataset.collapsed, "true");
  const firstWarning = items.find((i) => i.level === "warn").text;
  assert.ok(r[0].textContent.startsWith(`\u25B8 ${firstWarning} · `), r[0].textContent); // warnings lead
  assert.equal(r[0].dataset.level, "warn");
  for (const i of items) assert.ok(r[0].title.includes(i.text), `hover text has ${i.text}`);
  assert.equal(r[0].style.textOverflow, "ellipsis");
  assert.ok(node.size[1] <= limit, `node reaches ${node.size[1]}, the node below starts at ${limit}`);
  assert.equal(node.size[0], 200);
  assert.ok(node.widgets[0].options.getMinHeight() < 16 * 2 + 24);
  // the stored report and summary are the whole report
  assert.deepEqual(JSON.parse(node.properties.lora_runtime_report), report);
  assert.equal(node.properties.lora_runtime_summary, fmt.summarize(items));

  // a click shows every line (the user's choice), another folds them and the node shrinks back
  const body = node.widgets[0].element.children[0];
  assert.equal(typeof body.onclick, "function");
  body.onclick();
  assert.equal(rows(node).length, items.length);
  assert.ok(node.size[1] >= full);
  body.onclick();
  assert.equal(rows(node).length, 1);
  assert.ok(node.size[1] <= limit);

  // setting off and on: still folded
  setting(false);
  setting(true);
  assert.equal(rows(node).length, 1);
  assert.ok(node.size[1] <= limit);

  // the node below moved away: the next report shows every line, no click handler
  below.pos = [100, 2000];
  node.onExecuted({ lora_report: [fullReport()] });
  r = rows(node);
  assert.equal(r.length, items.length);
  assert.equal(body.onclick, null);
  assert.ok(node.size[1] >= full);
  assert.equal(node.size[0], 200);
  // a one-line report is never folded
  below.pos = [100, 150];
  node.onExecuted({ lora_report: [{ ...report, decision: null, adapters: [], fusions: null, tier: null,
    mode_requested: null, host: null, patch_seconds: null, sample_seconds: null, total_seconds: null,
    seconds_per_step: null, restore_bytes: null }] });
  assert.equal(rows(node).length, 1);
  assert.equal(rows(node)[0].dataset.collapsed, undefined);
});

test("Vue nodes: the report is shown inside the node's element, not through a widget", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  vueMode(true);
  try {
    const { host, body } = addVueNode(node.id);
    const report = fullReport();
    node.onExecuted({ lora_report: [report] });
    const root = vueRoot(body);
    assert.ok(root, "report element placed in the Vue node's body");
    assert.ok(host.querySelector(`[data-testid="node-body-${node.id}"]`).children.includes(root));
    const expected = fmt.formatReport(report);
    assert.deepEqual(root.children[0].children.map((r) => r.textContent), expected.map((i) => i.text));
    const line = root.children[0].children[0];
    assert.equal(line.style.whiteSpace, "nowrap", "one line each");
    assert.equal(line.style.textOverflow, "ellipsis", "cut with an ellipsis, never wider than the node");
    assert.equal(root.style.contain, "inline-size", "the lines do not widen the Vue node");
    assert.equal(root.style.maxWidth, undefined);
    // only the classic DOM widget (not serialized) is in node.widgets; nothing else was added
    assert.deepEqual(node.widgets.map((w) => w.type), ["lora_runtime_report"]);
    assert.equal(node.widgets[0].serialize, false);
    assert.equal(node.size[0], 200, "a Vue node sizes itself: the LiteGraph size is left alone");

    // a new run updates the lines in place
    node.onExecuted({ lora_report: [{ ...report, decision: null, adapters: [] }] });
    assert.equal(vueRoot(body), root);
    assert.equal(root.children[0].children[0].textContent, "no adapter applied");

    setting(false);
    assert.equal(root.children[0].style.display, "none");
    setting(true);
    assert.equal(root.children[0].style.display, "");

    // the renderer re-creates the node's element: the report is put back into the new one
    host.remove();
    const again = addVueNode(node.id);
    await new Promise((r) => setTimeout(r, 400));
    assert.equal(vueRoot(again.body), root);

    // back to the classic canvas: out of the Vue node, the DOM widget shows it
    vueMode(false);
    assert.equal(vueRoot(again.body), undefined);
    assert.equal(rows(node)[0].textContent, "no adapter applied");
    assert.equal(node.widgets[0].element.children[0].style.display, "");
    // and into the Vue node again when it is switched on
    vueMode(true);
    assert.equal(vueRoot(again.body), root);
    again.host.remove();
  } finally {
    vueMode(false);
    await new Promise((r) => setTimeout(r, 5));
  }
});

test("Vue nodes that show the DOM widget themselves (frontend 1.49): the report is shown once", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  vueMode(true);
  try {
    const { host, body } = addVueNode(node.id);
    node.onExecuted({ lora_report: [fullReport()] });
    assert.ok(vueRoot(body), "our element while the renderer shows no widget");
    // the renderer mounts the DOM widget's element inside the node
    body.appendChild(node.widgets[0].element);
    await new Promise((r) => setTimeout(r, 400));
    assert.equal(vueRoot(body), undefined, "our second element is taken out");
    assert.ok(body.children.includes(node.widgets[0].element));
    assert.equal(rows(node).length, fmt.formatReport(fullReport()).length);
    // a new run: the widget shows the new lines
    node.onExecuted({ lora_report: [{ ...fullReport(), decision: null, adapters: [] }] });
    assert.equal(rows(node)[0].textContent, "no adapter applied");
    assert.equal(vueRoot(body), undefined);
    setting(false);
    assert.equal(node.widgets[0].element.children[0].style.display, "none");
    setting(true);
    host.remove();
  } finally {
    vueMode(false);
    await new Promise((r) => setTimeout(r, 5));
  }
});

test("Vue nodes: a workflow loaded in Vue mode shows its report once the node is drawn", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const first = create(Sampler);
  first.onExecuted({ lora_report: [fullReport()] });
  vueMode(true);
  try {
    const loaded = new Sampler();
    loaded.properties = JSON.parse(JSON.stringify(first.properties));
    loaded.onConfigure?.({ properties: loaded.properties });
    const { host, body } = addVueNode(loaded.id); // drawn a moment after configure
    await new Promise((r) => setTimeout(r, 400));
    const root = vueRoot(body);
    assert.ok(root);
    assert.equal(root.children[0].children.length, rows(first).length);
    loaded.onRemoved?.();
    assert.equal(vueRoot(body), undefined, "removed with its node");
    host.remove();
  } finally {
    vueMode(false);
  }
});

test("stock sampler: the server's lora_runtime.report event shows the report on that node", async () => {
  setting(true);
  const KSampler = await register("KSampler");
  const node = create(KSampler);
  app.graph.nodes.set(String(node.id), node);
  const report = fullReport();
  api.dispatchEvent(new CustomEvent("lora_runtime.report", { detail: { node: String(node.id), report } }));
  await new Promise((r) => setTimeout(r, 5));
  assert.equal(node.widgets.length, 1, "the report widget is on the KSampler node");
  assert.deepEqual(JSON.parse(node.properties.lora_runtime_report), report);
  assert.ok(rows(node).length > 2);
  // saved and loaded again: the stock node shows it on load, without any prototype patch
  const again = create(KSampler);
  again.properties = { lora_runtime_report: node.properties.lora_runtime_report };
  ext.loadedGraphNode(again, app);
  assert.equal(again.widgets.length, 1);
  // garbage events and unknown nodes never throw
  api.dispatchEvent(new CustomEvent("lora_runtime.report", { detail: { node: "12345", report } }));
  api.dispatchEvent(new CustomEvent("lora_runtime.report", { detail: { node: String(node.id), report: "x" } }));
  api.dispatchEvent(new CustomEvent("lora_runtime.report", { detail: null }));
  ext.loadedGraphNode({ properties: { lora_runtime_report: "not json" } }, app);
  app.graph.nodes.delete(String(node.id));
});

test("our sampler ignores the event (its `executed` output brings the report); the report node shows it", async () => {
  setting(true);
  const Sampler = await register("LoraRuntimeSampler");
  const node = create(Sampler);
  app.graph.nodes.set(String(node.id), node);
  api.dispatchEvent(new CustomEvent("lora_runtime.report", { detail: { node: String(node.id), report: fullReport() } }));
  await new Promise((r) => setTimeout(r, 5));
  assert.equal(node.widgets.length, 0);
  app.graph.nodes.delete(String(node.id));
  const Report = await register("LoraRuntimeReport");
  const rn = create(Report);
  rn.onExecuted({ lora_report: [fullReport()] });
  assert.equal(rn.widgets.length, 1);
});

test("a node added from the node list is wide enough for its whole title; a loaded one keeps its saved size", async () => {
  setting(true);
  const Report = await register("LoraRuntimeReport");
  const node = new Report();
  node.title = "LoRA Runtime Report";
  node.size = [180, 46]; // what the core's computeSize gives a node without widgets
  node.onNodeCreated?.();
  // no canvas in this host: 19 characters at a generous 0.85 x 14 px, plus two title heights and a margin
  assert.ok(node.size[0] >= 19 * 14 * 0.85 + 60, node.size);
  assert.equal(node.size[1], 46, "only the width");
  const wide = new Report();
  wide.title = "LoRA Runtime Report";
  wide.size = [600, 46];
  wide.onNodeCreated?.();
  assert.deepEqual(wide.size, [600, 46], "never narrower");
});

// A canvas whose measureText gives a width per character that depends on the family: Inter narrower
// than the fallback (DejaVu Sans here), as in the browser (272 vs 295 px for the same title).
const measured = [];
function installCanvas() {
  const create = globalThis.document.createElement;
  globalThis.document.createElement = (tag) => (tag === "canvas" ? {
    getContext: () => ({
      font: "",
      measureText(text) {
        measured.push(this.font);
        const per = /Inter/.test(this.font) ? 7 : /Arial/.test(this.font) ? 7.5 : 8.5;
        return { width: String(text).length * per * (parseFloat(this.font) / 14) };
      },
    }),
  } : create(tag));
  return () => { globalThis.document.createElement = create; };
}

test("titleFont: the node's titleFontStyle, else the canvas' title font, else LiteGraph's; Arial only when none", () => {
  const { titleFont } = extModule;
  const saved = { lg: globalThis.LiteGraph, canvas: app.canvas };
  try {
    delete globalThis.LiteGraph;
    delete app.canvas;
    assert.equal(titleFont({ titleFontStyle: "14px Inter" }), "14px Inter");
    assert.equal(titleFont({}), "14px Arial", "the frontend names no font");
    app.canvas = { title_text_font: "15px Inter" };
    assert.equal(titleFont({}), "15px Inter");
    assert.equal(titleFont({ titleFontStyle: "13px Roboto" }), "13px Roboto");
    delete app.canvas;
    globalThis.LiteGraph = { NODE_TEXT_SIZE: 16, NODE_FONT: "Inter" };
    assert.equal(titleFont({}), "16px Inter");
    globalThis.LiteGraph = { NODE_FONT: "Inter" };
    assert.equal(titleFont({}), "14px Inter");
    globalThis.LiteGraph = { NODE_TEXT_SIZE: 12 };
    assert.equal(titleFont({}), "12px Arial");
    // a getter that throws is no font
    const bad = {};
    Object.defineProperty(bad, "titleFontStyle", { get() { throw new Error("no"); } });
    assert.equal(titleFont(bad), "12px Arial");
  } finally {
    if (saved.lg === undefined) delete globalThis.LiteGraph;
    else globalThis.LiteGraph = saved.lg;
    if (saved.canvas === undefined) delete app.canvas;
    else app.canvas = saved.canvas;
  }
});

test("a new node is as wide as its title in the font the canvas draws it with (Inter), on a Proxy size too", async () => {
  setting(true);
  const restore = installCanvas();
  try {
    const Report = await register("LoraRuntimeReport");
    Report.prototype.titleFontStyle = "14px Inter"; // LGraphNode's getter in frontends 1.49 / 1.58
    const node = new Report();
    node.title = "LoRA Runtime Report";
    node.size = [180, 46];
    measured.length = 0;
    node.onNodeCreated?.();
    assert.deepEqual(measured, ["14px Inter"]);
    assert.deepEqual(node.size, [Math.ceil(19 * 7 + 2 * 30 + 10), 46]);
    assert.equal(extModule.titleRoomWidth(node), node.size[0]);
    // frontend 1.58: node.size is a Proxy over a Float64Array (neither an Array nor a typed array)
    const proxied = new Report();
    proxied.title = "LoRA Runtime Report";
    const buf = new Float64Array([180, 46]);
    Object.defineProperty(proxied, "size", { get: () => new Proxy(buf, {}), configurable: true });
    proxied.setSize = (s) => { buf[0] = s[0]; buf[1] = s[1]; };
    proxied.onNodeCreated?.();
    assert.deepEqual([...buf], [203, 46]);
  } finally {
    restore();
  }
});

test("a title font that has not loaded yet: the node is widened once it has, not with the fallback's width", async () => {
  setting(true);
  const restore = installCanvas();
  let release;
  const loaded = new Set();
  globalThis.document.fonts = {
    check: (font) => loaded.has(font),
    load: (font) => new Promise((resolve) => { release = () => { loaded.add(font); resolve([]); }; }),
  };
  try {
    const Report = await register("LoraRuntimeReport");
    Report.prototype.titleFontStyle = "14px Inter";
    const node = new Report();
    node.title = "LoRA Runtime Report";
    node.size = [180, 46];
    node.onNodeCreated?.();
    assert.deepEqual(node.size, [180, 46], "not measured before the font is there");
    release();
    await new Promise((r) => setTimeout(r, 0));
    assert.deepEqual(node.size, [203, 46]);
    // a loaded node configured before the font arrives keeps its saved size
    loaded.clear();
    const saved = new Report();
    saved.title = "LoRA Runtime Report";
    saved.size = [180, 46];
    saved.onNodeCreated?.();
    saved.size = [150, 46]; // the workflow's size
    saved.onConfigure?.({});
    release();
    await new Promise((r) => setTimeout(r, 0));
    assert.deepEqual(saved.size, [150, 46]);
  } finally {
    delete globalThis.document.fonts;
    restore();
  }
});
