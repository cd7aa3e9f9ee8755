// Test harness: the web/ files are ES modules served by ComfyUI, and import
// "../../scripts/app.js". Here they are copied into a temporary tree that mirrors
// ComfyUI's URL layout (/scripts/*.js, /extensions/<pack>/*.js), with stub app/api
// modules and a package.json marking the tree as ES modules. No ComfyUI needed.
import { copyFileSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

export const WEB_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "web");

const APP_STUB = `
export const app = {
  extensions: [],
  settingValues: {},
  extensionManager: { setting: { get: (id) => app.settingValues[id] } },
  ui: { settings: new EventTarget() }, // the legacy settings dialog: dispatches "<id>.change"
  graph: { nodes: new Map(), getNodeById: (id) => app.graph.nodes.get(String(id)) },
  registerExtension(ext) { app.extensions.push(ext); },
};
`;

const API_STUB = `
class StubApi extends EventTarget {}
export const api = new StubApi();
`;

let root = null;

/** Build the tree once; returns file URLs of the copied modules and stubs. */
export function tree() {
  if (!root) {
    root = mkdtempSync(join(tmpdir(), "lora-runtime-web-"));
    const made = root;
    process.on("exit", () => rmSync(made, { recursive: true, force: true }));
    writeFileSync(join(root, "package.json"), JSON.stringify({ type: "module" }));
    mkdirSync(join(root, "scripts"));
    writeFileSync(join(root, "scripts", "app.js"), APP_STUB);
    writeFileSync(join(root, "scripts", "api.js"), API_STUB);
    const ext = join(root, "extensions", "comfyui-lora-runtime");
    mkdirSync(ext, { recursive: true });
    for (const f of readdirSync(WEB_DIR)) {
      if (f.endsWith(".js")) copyFileSync(join(WEB_DIR, f), join(ext, f));
    }
  }
  const ext = join(root, "extensions", "comfyui-lora-runtime");
  return {
    root,
    format: pathToFileURL(join(ext, "lora_report_format.js")).href,
    extension: pathToFileURL(join(ext, "lora_runtime.js")).href,
    app: pathToFileURL(join(root, "scripts", "app.js")).href,
    api: pathToFileURL(join(root, "scripts", "api.js")).href,
  };
}

/** A minimal DOM: enough for document.createElement-based rendering. */
export class FakeElement {
  constructor(tag) {
    this.tagName = String(tag).toUpperCase();
    this.style = {};
    this.dataset = {};
    this.attrs = {};
    this.children = [];
    this.parentNode = null;
    this.textContent = "";
    this.title = "";
    this.className = "";
    this.replaceCount = 0;
  }
  get firstChild() {
    return this.children[0] ?? null;
  }
  get parentElement() {
    return this.parentNode;
  }
  get isConnected() {
    let e = this;
    while (e.parentNode) e = e.parentNode;
    return e === globalThis.document?.body;
  }
  /** 6 px a character on one line; a container is as wide as its widest child. */
  get scrollWidth() {
    if (!this.children.length) return String(this.textContent).length * 6;
    return Math.max(...this.children.map((c) => c.scrollWidth));
  }
  contains(other) {
    for (let e = other; e; e = e.parentNode) if (e === this) return true;
    return false;
  }
  setAttribute(name, value) {
    this.attrs[name] = String(value);
  }
  appendChild(c) {
    c.parentNode?.removeChild(c);
    c.parentNode = this;
    this.children.push(c);
    return c;
  }
  removeChild(c) {
    this.children = this.children.filter((x) => x !== c);
    c.parentNode = null;
    return c;
  }
  remove() {
    this.parentNode?.removeChild(this);
  }
  replaceChildren(...cs) {
    this.replaceCount += 1;
    for (const c of this.children) c.parentNode = null;
    this.children = [];
    for (const c of cs) this.appendChild(c);
  }
  /** Only `[attr="value"]` selectors, searched depth first. */
  querySelector(sel) {
    const m = /^\[([\w-]+)="(.*)"\]$/.exec(sel);
    if (!m) return null;
    for (const c of this.children) {
      if (c.attrs[m[1]] === m[2]) return c;
      const found = c.querySelector(sel);
      if (found) return found;
    }
    return null;
  }
}

export function installFakeDocument() {
  const body = new FakeElement("body");
  globalThis.document = {
    body,
    createElement: (tag) => new FakeElement(tag),
    querySelector: (sel) => body.querySelector(sel),
  };
}

/** What the Vue node renderer puts in the page for a node: its element and its body. */
export function addVueNode(id) {
  const host = new FakeElement("div");
  host.setAttribute("data-node-id", String(id));
  const body = new FakeElement("div");
  body.setAttribute("data-testid", `node-body-${id}`);
  host.appendChild(body);
  globalThis.document.body.appendChild(host);
  return { host, body };
}

/** A stand-in for a ComfyUI node class (LGraphNode subset the extension uses). */
let nextNodeId = 1; // unique over every class, as in one graph

export function makeNodeClass({ withDomWidgets = true } = {}) {
  class FakeNode {
    constructor() {
      this.id = nextNodeId++;
      this.properties = {};
      this.pos = [0, 0];
      this.size = [200, 120];
      this.widgets = [];
      this.addDOMWidgetCalls = [];
    }
    computeSize() {
      let h = 100;
      for (const w of this.widgets) h += w.options?.getMinHeight?.() ?? 20;
      return [180, h];
    }
    setSize(s) {
      this.size = [...s];
    }
    setDirtyCanvas() {}
  }
  if (withDomWidgets) {
    FakeNode.prototype.addDOMWidget = function (name, type, element, options) {
      const w = { name, type, element, options };
      this.addDOMWidgetCalls.push([name, type, element, options]);
      this.widgets.push(w);
      return w;
    };
  }
  return FakeNode;
}

/** A report shaped like nodes/report.py build() output. */
export function fullReport() {
  return {
    host: "comfy",
    mode_requested: "auto",
    tier: "lossless",
    decision: {
      requested: "auto",
      chosen: "dynamic",
      share_lost: 0.78,
      reason: "stays unmerged: merging into the base weights would round away 78% of its update (> 50%)",
      layers: 240,
      cached: false,
      threshold: 0.5,
    },
    adapters: [
      {
        name: "style.safetensors",
        path: "/models/loras/style.safetensors",
        strength: 0.8,
        enabled: true,
        format: "kohya",
        layers: 240,
        coverage: {
          adapter: "style.safetensors",
          format: "kohya",
          matched: 240,
          file_layers: 240,
          model_linears: 400,
          unmatched: 0,
          unmatched_examples: [],
        },
      },
      {
        name: "partial.safetensors",
        path: "/models/loras/partial.safetensors",
        strength: 1.0,
        enabled: true,
        format: "peft",
        layers: 100,
        coverage: {
          adapter: "partial.safetensors",
          format: "peft",
          matched: 100,
          file_layers: 120,
          model_linears: 400,
          unmatched: 20,
          unmatched_examples: ["text_encoder.layers.0.q_proj (not a layer of this model)",
            "text_encoder.layers.1.q_proj (not a layer of this model)"],
        },
      },
    ],
    fusions: {
      mounted: 2,
      sites: [
        { site: "blocks.0.mlp", fusions: ["linear_gelu_tanh"], routes: { base_fused: 40, unfused: 0 } },
        { site: "blocks.1.mlp", fusions: ["linear_gelu_tanh"], routes: { base_fused: 40 } },
      ],
      skipped: 1,
      skip_reasons: ["bias missing"],
    },
    patch_seconds: 0.1234,
    restore_bytes: 3 * 1024 * 1024,
    sample_seconds: 24.6,
    seconds_per_step: 1.23,
    total_seconds: 24.9,
  };
}
