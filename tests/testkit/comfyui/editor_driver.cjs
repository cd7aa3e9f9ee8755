// Drives ComfyUI's editor in headless Chromium for tests/integration/test_browser.py.
//
//   node editor_driver.cjs CONFIG.json RESULTS.json
//
// CONFIG (written by the test): url, chromium, playwrightDir, screenshotDir, docsScreenshot,
// uiWorkflow {path, name, expected}, png {path, name, expected}, samplerId, adapterId,
// docsNodeIds, foldNeighbourId, stock {workflow {path, name, expected}, samplerId, reportId},
// timeouts {action, load, run}.
// `expected` is {nodeId: {type, widgets_values}} for the nodes the file holds.
//
// Every stage is run in order, each in its own try/catch: a failed stage is recorded
// (error + a screenshot) and the next stage still runs where it can. The test reads
// RESULTS and asserts stage by stage. Nothing outside 127.0.0.1 is reachable: every
// other request is aborted (and listed in results.blockedRequests).
"use strict";

const fs = require("fs");
const { harness } = require("./editor_harness.cjs");

const h = harness("editor_driver.cjs");
const { cfg, T, results, save, note, ensure, sleep, shot, stage, waitFor, settle, dropFile, queueFromUi } = h;
let page; // h.page, once main has opened the browser

const SETTING = "LoraRuntime.ShowBadges";
const VUE_SETTING = "Comfy.VueNodes.Enabled";
const REPORT_WIDGET = "lora_runtime_report";

// ------------------------------------------------------------------ page-side helpers
// (functions passed to page.evaluate run in the page: no closures over Node variables)

function pageGraphSnapshot() {
  const g = window.app.graph;
  const measureWith = (font, text) => {
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = font;
    return ctx.measureText(text).width;
  };
  const serialized = window.app.graph.serialize();
  const byId = {};
  for (const n of serialized.nodes) byId[n.id] = n;
  return {
    count: g.nodes.length,
    nodes: g.nodes.map((n) => ({
      id: n.id,
      type: n.type,
      title: n.title,
      widgets: (n.widgets || []).map((w) => ({
        name: w.name,
        type: w.type,
        value: w.value !== null && typeof w.value === "object" ? null : w.value,
      })),
      widgets_values: byId[n.id] ? byId[n.id].widgets_values : undefined,
      properties: n.properties,
      size: [n.size[0], n.size[1]],
      // the title as the canvas measures it, and the room it is drawn in (width less two title heights)
      titleWidth: measureWith(n.titleFontStyle || "14px Arial", String(n.title || "")),
      titleRoom: n.size[0] - 2 * ((window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30),
    })),
    links: serialized.links.length,
  };
}

function pageReportState(id) {
  const node = window.app.graph.getNodeById(id);
  if (!node) return { exists: false };
  const w = (node.widgets || []).find((x) => x.name === "lora_runtime_report");
  // Vue node renderer: the report is an element inside the node's own element;
  // classic canvas: the DOM widget's element in the DOM-widget overlay
  const vueNode = document.querySelector(`[data-node-id="${id}"]`);
  const vueEl = vueNode ? vueNode.querySelector(".lora-runtime-report") : null;
  const el = vueEl || (w && w.element);
  const body = el && el.firstElementChild;
  const rect = (e) => {
    if (!e) return null;
    const r = e.getBoundingClientRect();
    return { x: Math.round(r.x), y: Math.round(r.y), w: Math.round(r.width), h: Math.round(r.height) };
  };
  const shown = (e) => {
    if (!e || !e.isConnected) return false;
    const r = e.getBoundingClientRect();
    if (r.width <= 0 || r.height <= 0) return false;
    return typeof e.checkVisibility === "function"
      ? e.checkVisibility({ checkOpacity: true, checkVisibilityCSS: true })
      : true;
  };
  const nodeRect = vueNode ? rect(vueNode) : null;
  const elRect = rect(el);
  let insideNodeBox = null;
  let canvasNodeBox = null;
  if (el && el.isConnected) {
    // where the node is drawn on screen: the Vue element, or the canvas node's box
    let box = nodeRect;
    if (!box) {
      const c = window.app.canvas;
      const cr = c.canvas.getBoundingClientRect();
      const s = c.ds.scale;
      const th = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
      box = {
        x: Math.round(cr.x + (node.pos[0] + c.ds.offset[0]) * s),
        y: Math.round(cr.y + (node.pos[1] - th + c.ds.offset[1]) * s),
        w: Math.round(node.size[0] * s),
        h: Math.round((node.size[1] + th) * s),
      };
    }
    if (elRect && elRect.w > 0) {
      insideNodeBox = elRect.x >= box.x - 2 && elRect.y >= box.y - 2
        && elRect.x + elRect.w <= box.x + box.w + 2 && elRect.y + elRect.h <= box.y + box.h + 2;
    }
    canvasNodeBox = nodeRect ? null : box;
  }
  const rows = body ? [...body.children] : [];
  return {
    exists: true,
    type: node.type,
    hasWidget: !!w,
    widgetType: w ? w.type : null,
    widgetIndex: w ? node.widgets.indexOf(w) : -1,
    widgetCount: (node.widgets || []).length,
    shownBy: vueEl ? "vue-node" : (w ? "dom-widget" : null),
    domWidgetConnected: !!(w && w.element && w.element.isConnected),
    connected: !!(el && el.isConnected),
    bodyDisplay: body ? body.style.display : null,
    visible: shown(body),
    lines: rows.map((r) => ({ text: r.textContent, level: r.dataset.level, key: r.dataset.key, title: r.title,
      scrollWidth: r.scrollWidth, clientWidth: r.clientWidth, textOverflow: getComputedStyle(r).textOverflow,
      whiteSpace: getComputedStyle(r).whiteSpace, collapsed: r.dataset.collapsed === "true" })),
    collapsed: body ? body.dataset.collapsed === "true" : null,
    clickable: !!(body && typeof body.onclick === "function"),
    text: rows.map((r) => r.textContent).join("\n"),
    elementRect: elRect,
    vueNodeRect: nodeRect,
    canvasNodeBox,
    insideVueNode: vueNode ? !!(el && vueNode.contains(el)) : null,
    // how many of our report elements the Vue node shows (1: never the report twice)
    visibleReportsInNode: vueNode
      ? [...vueNode.querySelectorAll(".lora-runtime-report")].filter((e) => shown(e.firstElementChild)).length
      : null,
    insideNodeBox,
    parentClass: el && el.parentElement ? String(el.parentElement.className) : null,
    nodeSize: [Math.round(node.size[0]), Math.round(node.size[1])],
    properties: Object.assign({}, node.properties),
  };
}

function pageFocusNodes({ ids, pad, maxScale }) {
  const c = window.app.canvas;
  const th = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
  let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
  for (const id of ids) {
    const n = window.app.graph.getNodeById(id);
    if (!n) continue;
    const vue = document.querySelector(`[data-node-id="${id}"]`);
    let h = n.size[1];
    if (vue) h = Math.max(h, vue.getBoundingClientRect().height / c.ds.scale - th);
    x0 = Math.min(x0, n.pos[0]);
    y0 = Math.min(y0, n.pos[1] - th);
    x1 = Math.max(x1, n.pos[0] + n.size[0]);
    y1 = Math.max(y1, n.pos[1] + h);
  }
  if (!Number.isFinite(x0)) return null;
  const cw = c.canvas.clientWidth;
  const ch = c.canvas.clientHeight;
  const bw = x1 - x0;
  const bh = y1 - y0;
  const scale = Math.min(maxScale, (cw - 2 * pad) / bw, (ch - 2 * pad) / bh);
  c.ds.scale = scale;
  c.ds.offset[0] = (cw / scale - bw) / 2 - x0;
  c.ds.offset[1] = (ch / scale - bh) / 2 - y0;
  c.setDirty(true, true);
  const cr = c.canvas.getBoundingClientRect();
  return {
    scale,
    box: {
      x: cr.x + (x0 + c.ds.offset[0]) * scale,
      y: cr.y + (y0 + c.ds.offset[1]) * scale,
      w: bw * scale,
      h: bh * scale,
    },
  };
}

/**
 * Every node's box (graph units, title included) and, for each widget the canvas draws, whether
 * its label was drawn whole ("whole"), cut ("cut": only a prefix of it was drawn) or not at all
 * ("none"). Labels are read off one full redraw: CanvasRenderingContext2D.fillText is recorded
 * while each node's drawWidgets runs (the core's drawTextInArea draws a cut label without its
 * ellipsis, which it draws apart).
 */
function pageLayout() {
  const g = window.app.graph;
  const c = window.app.canvas;
  const th = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
  const drawn = new Map();
  let current = null;
  const proto = CanvasRenderingContext2D.prototype;
  const fillText = proto.fillText;
  const wrapped = [];
  for (const n of g.nodes) {
    if (typeof n.drawWidgets !== "function") continue;
    const own = Object.prototype.hasOwnProperty.call(n, "drawWidgets");
    const f = n.drawWidgets;
    n.drawWidgets = function (...a) {
      current = n.id;
      try {
        return f.apply(this, a);
      } finally {
        current = null;
      }
    };
    wrapped.push([n, own, f]);
  }
  proto.fillText = function (text, ...rest) {
    if (current !== null) {
      if (!drawn.has(current)) drawn.set(current, []);
      drawn.get(current).push(String(text));
    }
    return fillText.call(this, text, ...rest);
  };
  try {
    c.draw(true, true);
  } finally {
    proto.fillText = fillText;
    for (const [n, own, f] of wrapped) {
      if (own) n.drawWidgets = f;
      else delete n.drawWidgets;
    }
  }
  return {
    scale: c.ds.scale,
    lowQuality: !!c.low_quality,
    titleHeight: th,
    nodes: g.nodes.map((n) => {
      const texts = drawn.get(n.id) || [];
      const labels = (n.widgets || []).filter((w) => !(w.element instanceof HTMLElement) && w.type !== "hidden")
        .map((w) => {
          const label = String(w.displayName || w.label || w.name || "");
          let state = "none";
          if (texts.includes(label)) state = "whole";
          else if (texts.some((t) => t.length > 0 && t.length < label.length && label.startsWith(t))) state = "cut";
          return { name: w.name, label, state };
        });
      const collapsed = !!(n.flags && n.flags.collapsed);
      return {
        id: n.id,
        type: n.type,
        title: n.title,
        collapsed,
        pos: [n.pos[0], n.pos[1]],
        size: [n.size[0], n.size[1]],
        // the node as drawn: its title bar above pos, its body below
        box: {
          x: n.pos[0],
          y: n.pos[1] - th,
          w: collapsed ? (n._collapsed_width || n.size[0]) : n.size[0],
          h: collapsed ? th : n.size[1] + th,
        },
        labels,
        drewWidgets: drawn.has(n.id),
      };
    }),
  };
}

/**
 * The font the canvas draws node titles in, read off one redraw (CanvasRenderingContext2D.fillText
 * recorded with the context's font, for the texts that are a node's title or a cut prefix of it), and
 * what the page knows of that font: its family's FontFaces (a web font the frontend ships) and their
 * status, document.fonts.check, and the width of one title in it, in the harness's DejaVu Sans and in
 * "Arial". Then a node added as the node list adds one (LiteGraph.createNode + graph.add: the
 * extension's onNodeCreated), its width once any font load has settled, and the font the extension
 * measures with (its titleFont, from the same module instance the page loaded).
 */
async function pageTitleFont(a) {
  const c = window.app.canvas;
  const titles = new Map(window.app.graph.nodes.map((n) => [String(n.title || ""), n.id]));
  const drawn = [];
  const proto = CanvasRenderingContext2D.prototype;
  const fillText = proto.fillText;
  proto.fillText = function (text, ...rest) {
    const t = String(text);
    for (const title of titles.keys()) {
      if (title && (t === title || (t.length > 3 && title.startsWith(t.replace(/\u2026$/, ""))))) {
        drawn.push({ text: t, title, font: this.font });
        break;
      }
    }
    return fillText.call(this, text, ...rest);
  };
  try {
    c.draw(true, true);
  } finally {
    proto.fillText = fillText;
  }
  const fonts = [...new Set(drawn.map((d) => d.font))];
  const font = fonts[0] || null;
  const family = font ? font.replace(/^.*?\d+(?:\.\d+)?px\s*/, "").replace(/["']/g, "").trim() : null;
  const ctx = document.createElement("canvas").getContext("2d");
  const measure = (f, text) => {
    ctx.font = f;
    return ctx.measureText(text).width;
  };
  const size = font ? font.match(/(\d+(?:\.\d+)?)px/)[1] : "14";
  const faces = [...document.fonts].filter((f) => f.family.replace(/["']/g, "") === family)
    .map((f) => ({ family: f.family, weight: f.weight, style: f.style, status: f.status }));
  const lg = window.LiteGraph || {};
  const th = lg.NODE_TITLE_HEIGHT || 30;
  // a node added the way the node list adds one
  const node = lg.createNode(a.nodeType);
  window.app.graph.add(node);
  const created = [node.size[0], node.size[1]];
  if (font) await document.fonts.load(font).catch(() => null);
  await new Promise((r) => setTimeout(r, 200));
  let ours = null;
  try {
    const mod = await import(a.extensionUrl);
    ours = typeof mod.titleFont === "function" ? mod.titleFont(node) : null;
  } catch (e) {
    ours = `import failed: ${e}`;
  }
  const out = {
    drawn: drawn.slice(0, 20),
    fonts,
    font,
    family,
    nodeFont: lg.NODE_FONT || null,
    nodeTextSize: lg.NODE_TEXT_SIZE || null,
    titleFontStyle: node.titleFontStyle || null,
    extensionFont: ours,
    faces,
    check: font ? document.fonts.check(font) : null,
    probe: a.probe,
    widths: {
      drawn: font ? measure(font, a.probe) : null,
      dejavu: measure(`${size}px 'DejaVu Sans'`, a.probe),
      arial: measure(`${size}px Arial`, a.probe),
    },
    node: {
      type: node.type,
      title: node.title,
      created,
      size: [node.size[0], node.size[1]],
      titleWidth: font ? measure(font, String(node.title)) : null,
      titleWidthDejavu: measure(`${size}px 'DejaVu Sans'`, String(node.title)),
      titleHeight: th,
    },
  };
  window.app.graph.remove(node);
  c.setDirty(true, true);
  return out;
}

// ------------------------------------------------------------------ node-side helpers

async function graphSnapshot() {
  return page.evaluate(pageGraphSnapshot);
}

async function reportState(id) {
  return page.evaluate(pageReportState, id);
}

/** pageLayout() with every node on screen at (about) 100 %: the wide window, then back. */
async function layoutSnapshot() {
  const vp = page.viewportSize();
  const big = cfg.layoutViewport || cfg.docsViewport || { width: 2400, height: 900 };
  await page.setViewportSize(big);
  await settle(800);
  const ids = await page.evaluate(() => window.app.graph.nodes.map((n) => n.id));
  await focusNodes(ids, 48, 1.0);
  const snap = await page.evaluate(pageLayout);
  await page.setViewportSize(vp);
  await settle(800);
  await focusNodes(cfg.docsNodeIds, 30, 1.0);
  return snap;
}

/** Pairs of nodes whose boxes overlap (by more than half a unit each way). */
function overlaps(snap) {
  const out = [];
  const ns = snap.nodes;
  for (let i = 0; i < ns.length; i += 1) {
    for (let j = i + 1; j < ns.length; j += 1) {
      const a = ns[i].box;
      const b = ns[j].box;
      const dx = Math.min(a.x + a.w, b.x + b.w) - Math.max(a.x, b.x);
      const dy = Math.min(a.y + a.h, b.y + b.h) - Math.max(a.y, b.y);
      if (dx > 0.5 && dy > 0.5) out.push({ a: ns[i].id, b: ns[j].id, dx, dy, boxA: a, boxB: b });
    }
  }
  return out;
}

async function focusNodes(ids, pad = 40, maxScale = 1.0) {
  const r = await page.evaluate(pageFocusNodes, { ids, pad, maxScale });
  await settle();
  return r;
}

/** waitFor that records a timeout in rec.waitErrors instead of failing the stage. */
async function softWaitFor(rec, desc, fn, arg, timeout = T.action) {
  try {
    await waitFor(desc, fn, arg, timeout);
    return true;
  } catch (e) {
    (rec.waitErrors = rec.waitErrors || []).push(String(e.message || e));
    return false;
  }
}

async function setSetting(id, value) {
  await page.evaluate(async (a) => window.app.extensionManager.setting.set(a.id, a.value), { id, value });
  return page.evaluate((id2) => window.app.extensionManager.setting.get(id2), id);
}

function compareNodes(snapshot, expected) {
  const problems = [];
  const byId = {};
  for (const n of snapshot.nodes) byId[String(n.id)] = n;
  for (const [id, exp] of Object.entries(expected)) {
    const got = byId[id];
    if (!got) {
      problems.push(`node ${id} (${exp.type}) missing`);
      continue;
    }
    if (got.type !== exp.type) problems.push(`node ${id}: type ${got.type} != ${exp.type}`);
    const a = JSON.stringify(got.widgets_values ?? []);
    const b = JSON.stringify(exp.widgets_values ?? []);
    if (a !== b) problems.push(`node ${id} (${exp.type}): widgets_values ${a} != ${b}`);
  }
  return problems;
}

async function waitForGraph(expected, desc) {
  const ids = Object.keys(expected).map(Number);
  const types = Object.values(expected).map((e) => e.type);
  await waitFor(
    desc,
    (a) => {
      const g = window.app && window.app.graph;
      if (!g) return false;
      return a.ids.every((id, i) => {
        const n = g.getNodeById(id);
        return n && n.type === a.types[i];
      }) && g.nodes.length === a.ids.length;
    },
    { ids, types },
    T.action,
  );
}

async function clearGraph() {
  await page.evaluate(() => {
    window.app.graph.clear();
    window.app.canvas.setDirty(true, true);
  });
  await waitFor("an empty graph", () => window.app.graph.nodes.length === 0, null);
}

async function waitForReport(id, desc, extra = null) {
  await waitFor(
    desc,
    (a) => {
      const n = window.app.graph.getNodeById(a.id);
      const w = n && (n.widgets || []).find((x) => x.name === "lora_runtime_report");
      const body = w && w.element && w.element.firstElementChild;
      if (!body || !body.children.length || !w.element.isConnected) return false;
      if (a.extra && a.extra.notProperty !== undefined
        && n.properties[a.extra.property] === a.extra.notProperty) return false;
      return true;
    },
    { id, extra },
    T.action,
  );
  await settle();
  return reportState(id);
}

// ------------------------------------------------------------------ the run

async function main() {
  page = await h.open();
  try {
    // 1. the editor ------------------------------------------------------------
    const loaded = await stage("load", async (rec) => {
      await page.goto(cfg.url, { waitUntil: "domcontentloaded", timeout: T.load });
      await waitFor("the editor (window.app with a graph and the Vue app ready)",
        () => window.app && window.app.graph && window.app.canvas && window.app.vueAppReady
          && window.app.extensionManager && window.app.extensionManager.setting, null, T.load);
      // the default workflow is loaded a moment after the app is ready
      await waitFor("the start-up workflow", () => window.app.graph.nodes.length > 0, null, T.action).catch(() => {});
      await settle(1000);
      Object.assign(rec, await page.evaluate(() => ({
        frontendVersion: window.__COMFYUI_FRONTEND_VERSION__ || null,
        extensions: window.app.extensions.map((e) => e.name),
        showBadges: window.app.extensionManager.setting.get("LoraRuntime.ShowBadges"),
        settingRegistered: !!(window.app.ui.settings.settingsLookup || {})["LoraRuntime.ShowBadges"]
          || window.app.extensionManager.setting.get("LoraRuntime.ShowBadges") !== undefined,
        vueSettingKnown: window.app.extensionManager.setting.get("Comfy.VueNodes.Enabled") !== undefined,
        vueNodes: window.app.extensionManager.setting.get("Comfy.VueNodes.Enabled"),
        startNodes: window.app.graph.nodes.length,
        // the font the canvas gets for "Arial" (LiteGraph's NODE_FONT): widths of one title in three families
        fonts: (() => {
          const ctx = document.createElement("canvas").getContext("2d");
          const text = "Negative prompt (empty = unconditional)";
          const out = { text };
          for (const [k, f] of [["arial", "14px Arial"], ["dejavu", "14px 'DejaVu Sans'"],
            ["liberation", "14px 'Liberation Sans'"], ["nodeFont", `14px ${window.LiteGraph && window.LiteGraph.NODE_FONT}`]]) {
            ctx.font = f;
            out[k] = ctx.measureText(text).width;
          }
          return out;
        })(),
        runButton: !!document.querySelector('[data-testid="queue-button"]'),
        openDialogs: [...document.querySelectorAll(".p-dialog")].map((d) => d.innerText.slice(0, 120)),
      })));
      results.versions.frontend = rec.frontendVersion;
      // the test seeds Comfy.Minimap.Visible=false (the minimap panel covers the canvas' corner)
      rec.minimapVisible = await page.evaluate(() => window.app.extensionManager.setting.get("Comfy.Minimap.Visible"));
      ensure(rec.extensions.includes("comfyui_lora_runtime.report"),
        "the pack's extension comfyui_lora_runtime.report is not registered");
      // websocket events, recorded for the whole session
      await page.evaluate(() => {
        window.__loraIT = { events: [] };
        const types = ["execution_start", "execution_success", "execution_error", "execution_interrupted",
          "execution_cached", "executed", "lora_runtime.report"];
        for (const t of types) {
          window.app.api.addEventListener(t, (e) => {
            const d = e.detail || {};
            window.__loraIT.events.push({
              type: t,
              prompt_id: d.prompt_id,
              node: d.display_node ?? d.node ?? null,
              detail: t === "execution_error" || t === "execution_interrupted" ? d : undefined,
              at: Date.now(),
            });
          });
        }
      });
      await shot("editor_loaded");
    });
    if (!loaded) return;

    // 2. drag-and-drop the UI workflow file ----------------------------------------
    h.stageName = "drop_json";
    await stage("drop_json", async (rec) => {
      await clearGraph();
      rec.method = "drop event with a DataTransfer holding a File, dispatched on the canvas element";
      rec.dispatch = await dropFile(cfg.uiWorkflow.path, cfg.uiWorkflow.name, "application/json");
      await waitForGraph(cfg.uiWorkflow.expected, `the nodes of ${cfg.uiWorkflow.name}`);
      await settle();
      const snap = await graphSnapshot();
      rec.graph = snap;
      rec.problems = compareNodes(snap, cfg.uiWorkflow.expected);
      rec.workflowName = await page.evaluate(() => {
        const w = window.app.extensionManager.workflow && window.app.extensionManager.workflow.activeWorkflow;
        return w ? (w.filename || w.path || null) : null;
      });
      await page.evaluate(() => window.app.canvas.ds && window.app.canvas.setDirty(true, true));
      await focusNodes(Object.keys(cfg.uiWorkflow.expected).map(Number), 30, 1.0);
      await shot("dropped_ui_workflow");
      ensure(!rec.problems.length, rec.problems.join("; "));
    });

    // 2b. the title font: the one the canvas draws titles in, loaded, and the one the extension sizes with
    h.stageName = "title_font";
    await stage("title_font", async (rec) => {
      await focusNodes(cfg.docsNodeIds, 30, 1.0); // near 100 %: a zoomed-out canvas draws no titles
      Object.assign(rec, await page.evaluate(pageTitleFont, {
        nodeType: cfg.titleFont.nodeType, probe: cfg.titleFont.probe,
        extensionUrl: new URL(cfg.titleFont.extensionPath, cfg.url).href }));
      ensure(rec.font, "no node title was drawn on the canvas");
    });

    // 3. drag-and-drop a PNG the pack saved ------------------------------------------
    h.stageName = "drop_png";
    await stage("drop_png", async (rec) => {
      await clearGraph();
      rec.method = "drop event with a DataTransfer holding a PNG File, dispatched on the canvas element";
      rec.dispatch = await dropFile(cfg.png.path, cfg.png.name, "image/png");
      await waitForGraph(cfg.png.expected, `the nodes of the workflow in ${cfg.png.name}`);
      await settle();
      const snap = await graphSnapshot();
      rec.graph = snap;
      rec.problems = compareNodes(snap, cfg.png.expected);
      await focusNodes(Object.keys(cfg.png.expected).map(Number), 30, 1.0);
      await shot("dropped_png");
      ensure(!rec.problems.length, rec.problems.join("; "));
    });

    // 4. queue it from the UI and read the report ---------------------------------------
    h.stageName = "run";
    const ran = await stage("run", async (rec) => {
      const expected = cfg.png.expected;
      const haveGraph = await page.evaluate(
        (ids) => ids.every((id) => window.app.graph.getNodeById(id)), Object.keys(expected).map(Number));
      if (!haveGraph) {
        // the drop failed: load the same workflow through the API so the rest still runs
        await page.evaluate((wf) => window.app.loadGraphData(wf, true, true, "fallback"),
          JSON.parse(fs.readFileSync(cfg.uiWorkflow.path, "utf-8")));
        rec.loadedViaFallback = true;
      }
      rec.layoutBefore = await layoutSnapshot();
      await focusNodes(cfg.docsNodeIds, 30, 1.0);
      rec.before = await reportState(cfg.samplerId);
      await queueFromUi(rec);
      rec.sampler = await waitForReport(cfg.samplerId, "the sampler's report widget");
      rec.adapter = await waitForReport(cfg.adapterId, "the adapter node's coverage widget");
      rec.settingValue = await page.evaluate((s) => window.app.extensionManager.setting.get(s), SETTING);
      await shot("report_after_run");
      if (cfg.docsScreenshot) {
        // the whole workflow at 100 %: a wider window for this one picture
        const vp = page.viewportSize();
        const big = cfg.docsViewport || { width: 2400, height: 900 };
        await page.setViewportSize(big);
        await settle(1000);
        const f = await focusNodes(cfg.docsShotNodeIds || cfg.docsNodeIds, 48, 1.0);
        const clip = {
          x: Math.max(0, Math.floor(f.box.x - 16)),
          y: Math.max(0, Math.floor(f.box.y - 40)),
          width: Math.ceil(f.box.w + 32),
          height: Math.ceil(f.box.h + 56),
        };
        clip.width = Math.min(clip.width, big.width - clip.x);
        clip.height = Math.min(clip.height, big.height - clip.y);
        rec.docsClip = clip;
        rec.docsScale = f.scale;
        await page.screenshot({ path: cfg.docsScreenshot, clip, timeout: T.action });
        results.screenshots.push({ name: "docs", path: cfg.docsScreenshot });
        await page.setViewportSize(vp);
        await settle(1000);
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
      }
      ensure(rec.sampler.visible, "the sampler's report is not visible");
      ensure(rec.adapter.visible, "the adapter node's coverage is not visible");
    });

    // 4b. the layout after the run: no node covers another, no widget label newly cut --------
    h.stageName = "layout";
    if (ran) {
      await stage("layout", async (rec) => {
        rec.after = await layoutSnapshot();
        rec.overlaps = overlaps(rec.after);
        rec.overlapsBefore = overlaps(results.stages.run.layoutBefore);
        const vp = page.viewportSize();
        await page.setViewportSize(cfg.docsViewport || { width: 2400, height: 900 });
        await settle(800);
        await focusNodes(rec.after.nodes.map((n) => n.id), 48, 1.0);
        await shot("layout_after_run");
        await page.setViewportSize(vp);
        await settle(800);
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
      });
    }

    // 4c. a node right under the sampler: the report folds to one line, a click unfolds it ---
    h.stageName = "fold";
    if (ran && cfg.foldNeighbourId) {
      await stage("fold", async (rec) => {
        const setting = (v) => setSetting(SETTING, v);
        rec.full = await reportState(cfg.samplerId);
        // under the sampler: room for the one-line badge, not for every line
        rec.moved = await page.evaluate((a) => {
          const s = window.app.graph.getNodeById(a.sampler);
          const n = window.app.graph.getNodeById(a.neighbour);
          const th = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
          const was = [n.pos[0], n.pos[1]];
          const saved = (a.lines - 1) * 16; // what folding saves
          n.pos = [s.pos[0] + 20, s.pos[1] + s.size[1] - saved / 2 + th + 8];
          window.app.canvas.setDirty(true, true);
          return { was, now: [n.pos[0], n.pos[1]], samplerBottom: s.pos[1] + s.size[1] };
        }, { sampler: cfg.samplerId, neighbour: cfg.foldNeighbourId, lines: rec.full.lines.length });
        // the layout is decided when the report is shown: the setting off and on shows it again
        await setting(false);
        await settle();
        await setting(true);
        await focusNodes([cfg.samplerId, cfg.foldNeighbourId], 60, 1.0);
        rec.folded = await reportState(cfg.samplerId);
        rec.foldedLayout = await layoutSnapshot();
        rec.foldedOverlaps = overlaps(rec.foldedLayout);
        await focusNodes([cfg.samplerId, cfg.foldNeighbourId], 60, 1.0);
        await shot("report_folded_above_a_node");
        // a click on the badge (the user's choice) shows every line ...
        const badge = page.locator(`.lora-runtime-report [data-collapsed="true"]`).first();
        await badge.click({ timeout: T.action });
        await settle();
        rec.unfolded = await reportState(cfg.samplerId);
        await shot("report_unfolded_by_click");
        // ... another folds it again
        await page.evaluate((id) => {
          const n = window.app.graph.getNodeById(id);
          const w = n.widgets.find((x) => x.name === "lora_runtime_report");
          return w.element.firstElementChild.click();
        }, cfg.samplerId);
        await settle();
        rec.refolded = await reportState(cfg.samplerId);
        // the neighbour back where it was: the next showing has every line again
        await page.evaluate((a) => {
          const n = window.app.graph.getNodeById(a.neighbour);
          n.pos = a.was;
          window.app.canvas.setDirty(true, true);
        }, { neighbour: cfg.foldNeighbourId, was: rec.moved.was });
        await setting(false);
        await settle();
        await setting(true);
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
        rec.back = await reportState(cfg.samplerId);
        rec.backOverlaps = overlaps(await layoutSnapshot());
        ensure(rec.folded.collapsed, "the report did not fold with a node right under the sampler");
      });
    }

    // 5. the ShowBadges setting ------------------------------------------------------------
    h.stageName = "toggle";
    if (ran) {
      await stage("toggle", async (rec) => {
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
        rec.on0 = await reportState(cfg.samplerId);
        rec.offValue = await setSetting(SETTING, false);
        await settle();
        rec.off = await reportState(cfg.samplerId);
        rec.offAdapter = await reportState(cfg.adapterId);
        await shot("badges_off");
        rec.onValue = await setSetting(SETTING, true);
        await settle();
        rec.on = await reportState(cfg.samplerId);
        rec.onAdapter = await reportState(cfg.adapterId);
        await shot("badges_on_again");
      });
    }

    // 6. the report comes back from node.properties when the saved workflow is loaded ----------
    h.stageName = "restore";
    if (ran) {
      await stage("restore", async (rec) => {
        const saved = await page.evaluate(() => window.app.graph.serialize());
        rec.savedProperties = (saved.nodes.find((n) => String(n.id) === String(cfg.samplerId)) || {}).properties;
        await clearGraph();
        await page.evaluate((wf) => window.app.loadGraphData(wf, true, true, "lora-runtime-restored"), saved);
        await waitForGraph(cfg.png.expected, "the re-loaded workflow");
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
        rec.sampler = await waitForReport(cfg.samplerId, "the restored report widget");
        rec.adapter = await waitForReport(cfg.adapterId, "the restored coverage widget");
        // the report widget adds nothing to widgets_values (saved workflow) nor to the prompt
        rec.problems = compareNodes(await graphSnapshot(), cfg.png.expected);
        rec.promptInputs = await page.evaluate(async (id) => {
          const p = await window.app.graphToPrompt();
          return Object.keys(p.output[String(id)].inputs);
        }, cfg.samplerId);
        await shot("report_restored_from_properties");
      });
    }

    // 7. the Vue node renderer ("Nodes 2.0") ---------------------------------------------------
    h.stageName = "vue";
    if (ran) {
      await stage("vue", async (rec) => {
        rec.available = await page.evaluate((s) => {
          const store = window.app.extensionManager.setting;
          return store.get(s) !== undefined;
        }, VUE_SETTING);
        if (!rec.available) return;
        rec.enabledValue = await setSetting(VUE_SETTING, true);
        await waitFor("Vue nodes ([data-node-id] elements)",
          (id) => !!document.querySelector(`[data-node-id="${id}"]`), cfg.samplerId, T.action);
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
        await settle(1500);
        rec.vueNodeCount = await page.evaluate(() => document.querySelectorAll("[data-node-id]").length);
        // the report (from before the switch) inside the Vue nodes
        for (const id of [cfg.samplerId, cfg.adapterId]) {
          await softWaitFor(rec, `the report inside Vue node ${id}`, (i) => {
            const host = document.querySelector(`[data-node-id="${i}"]`);
            const body = host && host.querySelector(".lora-runtime-report > div");
            return !!body && body.isConnected && body.children.length > 0 && body.style.display !== "none";
          }, id);
        }
        await settle();
        rec.afterSwitch = await reportState(cfg.samplerId);
        rec.adapterAfterSwitch = await reportState(cfg.adapterId);
        await shot("vue_nodes_report_after_switch");
        // a new run with the Vue renderer on (another seed, so the sampler runs again)
        const oldProp = rec.afterSwitch.properties.lora_runtime_report;
        rec.seedSet = await page.evaluate((id) => {
          const n = window.app.graph.getNodeById(id);
          const w = n.widgets.find((x) => x.name === "seed");
          w.value = Number(w.value) + 1;
          if (w.callback) w.callback(w.value);
          return w.value;
        }, cfg.samplerId);
        const run = {};
        rec.run = run;
        await queueFromUi(run);
        // the node received the new report (stored in its properties), shown or not
        await waitFor("the sampler's new report in node.properties",
          (a) => {
            const n = window.app.graph.getNodeById(a.id);
            const v = n && n.properties && n.properties.lora_runtime_report;
            return typeof v === "string" && v !== a.old;
          }, { id: cfg.samplerId, old: oldProp }, T.action);
        // ... and shows it inside its Vue node (the lines of the new report, not the old ones)
        await softWaitFor(rec, "the new report's lines inside the sampler's Vue node",
          (i) => {
            const host = document.querySelector(`[data-node-id="${i}"]`);
            const body = host && host.querySelector(".lora-runtime-report > div");
            if (!body || !body.isConnected || body.style.display === "none") return false;
            const lines = [...body.children].map((r) => r.textContent);
            return lines.join(" | ") === window.app.graph.getNodeById(i).properties.lora_runtime_summary;
          }, cfg.samplerId);
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
        await settle(1000);
        rec.afterRun = await reportState(cfg.samplerId);
        rec.adapterAfterRun = await reportState(cfg.adapterId);
        rec.promptInputs = await page.evaluate(async (id) => {
          const p = await window.app.graphToPrompt();
          return { inputs: Object.keys(p.output[String(id)].inputs),
            widgetsValues: p.workflow.nodes.find((n) => String(n.id) === String(id)).widgets_values };
        }, cfg.samplerId);
        await shot("vue_nodes_report_after_run");
        rec.offValue = await setSetting(SETTING, false);
        await settle(1000);
        rec.off = await reportState(cfg.samplerId);
        await shot("vue_nodes_badges_off");
        rec.onValue = await setSetting(SETTING, true);
        await settle(1000);
        rec.on = await reportState(cfg.samplerId);
        await shot("vue_nodes_badges_on_again");
      });
      // back to the classic canvas: the report must be shown there again
      h.stageName = "classic_again";
      await stage("classic_again", async (rec) => {
        rec.vueValue = await setSetting(VUE_SETTING, false);
        await waitFor("the classic canvas (no [data-node-id] elements)",
          () => !document.querySelector("[data-node-id]"), null, T.action);
        await focusNodes(cfg.docsNodeIds, 30, 1.0);
        await settle(1000);
        rec.sampler = await reportState(cfg.samplerId);
        rec.adapter = await reportState(cfg.adapterId);
        await shot("classic_canvas_again");
        // for the record (not asserted): the sizes the Vue renderer left on the LiteGraph nodes
        rec.layout = await layoutSnapshot();
        rec.overlaps = overlaps(rec.layout);
      });
    }
    // 9. ComfyUI's own KSampler with our adapter nodes, and the LoRA Runtime Report node ----------
    h.stageName = "stock";
    if (cfg.stock) {
      await stage("stock", async (rec) => {
        const wf = cfg.stock.workflow;
        await clearGraph();
        rec.dispatch = await dropFile(wf.path, wf.name, "application/json");
        await waitForGraph(wf.expected, `the nodes of ${wf.name}`);
        await settle();
        rec.problems = compareNodes(await graphSnapshot(), wf.expected);
        ensure(!rec.problems.length, rec.problems.join("; "));
        rec.layoutBefore = await layoutSnapshot();
        const ids = [cfg.stock.samplerId, cfg.stock.reportId];
        await focusNodes(Object.keys(wf.expected).map(Number), 30, 1.0);
        rec.before = await reportState(cfg.stock.samplerId);
        const mark = await page.evaluate(() => window.__loraIT.events.length);
        await queueFromUi(rec);
        rec.reportEvents = await page.evaluate(
          (a) => window.__loraIT.events.slice(a.m).filter((e) => e.type === "lora_runtime.report"),
          { m: mark });
        rec.sampler = await waitForReport(cfg.stock.samplerId, "the KSampler's report widget");
        rec.report = await waitForReport(cfg.stock.reportId, "the LoRA Runtime Report node's report widget");
        // the two nodes with a report, near 100 % (the whole graph in this window is zoomed out so far
        // that the canvas hides DOM widgets)
        await focusNodes(ids, 30, 1.0);
        rec.sampler = await reportState(cfg.stock.samplerId);
        rec.report = await reportState(cfg.stock.reportId);
        await shot("stock_ksampler_report_after_run");
        rec.layout = await layoutSnapshot();
        rec.overlaps = overlaps(rec.layout);
        rec.promptInputs = await page.evaluate(async (id) => {
          const p = await window.app.graphToPrompt();
          return { inputs: Object.keys(p.output[String(id)].inputs), classType: p.output[String(id)].class_type,
            widgetsValues: p.workflow.nodes.find((n) => String(n.id) === String(id)).widgets_values };
        }, cfg.stock.samplerId);
        // saved and loaded again: the stock node shows the report from its properties
        const saved = await page.evaluate(() => window.app.graph.serialize());
        rec.savedProperties = (saved.nodes.find((n) => String(n.id) === String(cfg.stock.samplerId)) || {}).properties;
        await clearGraph();
        await page.evaluate((w) => window.app.loadGraphData(w, true, true, "lora-runtime-stock-restored"), saved);
        await waitForGraph(wf.expected, "the re-loaded stock workflow");
        await focusNodes(ids, 30, 1.0);
        rec.restored = await waitForReport(cfg.stock.samplerId, "the KSampler's restored report widget");
        await shot("stock_ksampler_report_restored");
        ensure(rec.sampler.visible, "the KSampler's report is not visible");
        ensure(rec.report.visible, "the report node's report is not visible");
      });
    }

    // 10. Browse Templates: the pack's workflow from ComfyUI's template dialog, then run ------------
    h.stageName = "template";
    if (cfg.template) {
      await stage("template", async (rec) => {
        const t = cfg.template;
        await clearGraph();
        // what the dialog reads: GET /api/workflow_templates through the frontend's own api client
        rec.listed = await page.evaluate(async (pack) => {
          const all = await window.app.api.getWorkflowTemplates();
          return all[pack] || null;
        }, t.pack);
        ensure(rec.listed && rec.listed.includes(t.name), `the pack's templates do not include ${t.name}`);
        await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.BrowseTemplates"));
        const content = page.locator('[data-testid="template-workflows-content"]').first();
        await content.waitFor({ state: "visible", timeout: T.action });
        await settle();
        await shot("templates_dialog");
        const card = page.locator(`[data-testid="template-workflow-${t.name}"]`).first();
        const visible = async () => (await card.count()) > 0 && card.isVisible();
        rec.foundVia = null;
        if (await visible()) rec.foundVia = "first view";
        // the pack's own category in the dialog's navigation (frontend 1.27: titled with the pack's folder name)
        if (!rec.foundVia) {
          const nav = page.locator(".p-dialog, [role=dialog]").getByText(t.pack, { exact: true }).first();
          if ((await nav.count()) > 0) {
            await nav.click().catch((e) => { rec.navError = String(e).split("\n")[0]; });
            await settle();
            if (await visible()) rec.foundVia = `navigation: ${t.pack}`;
          }
        }
        // or the dialog's search box (frontend 1.49: extension templates are searchable by name and pack)
        if (!rec.foundVia) {
          const search = page.locator(".p-dialog input, [role=dialog] input").first();
          if ((await search.count()) > 0) {
            await search.fill(t.name).catch((e) => { rec.searchError = String(e).split("\n")[0]; });
            await settle(1000);
            if (await visible()) rec.foundVia = `search: ${t.name}`;
          }
        }
        if (!rec.foundVia) {
          await card.scrollIntoViewIfNeeded({ timeout: 5000 }).catch(() => {});
          if (await visible()) rec.foundVia = "scrolled";
        }
        await shot("templates_our_card");
        ensure(rec.foundVia, `no card template-workflow-${t.name} in the Browse Templates dialog`);
        rec.thumbnail = await card.evaluate((el) => [...el.querySelectorAll("img")].map((i) => i.getAttribute("src")));
        await card.click();
        await waitForGraph(t.expected, `the nodes of the template ${t.name}`);
        await settle();
        rec.dialogOpen = await content.isVisible().catch(() => false);
        rec.problems = compareNodes(await graphSnapshot(), t.expected);
        await focusNodes(Object.keys(t.expected).map(Number), 30, 1.0);
        await shot("template_loaded");
        ensure(!rec.problems.length, rec.problems.join("; "));
        if (t.run) {
          // every node executes again (the same graph ran in the run stage): ComfyUI drops its cached outputs
          rec.freed = await page.evaluate(async () => (await window.app.api.fetchApi("/free", {
            method: "POST", headers: { "Content-Type": "application/json" },
            body: JSON.stringify({ unload_models: true, free_memory: true }) })).status);
          await queueFromUi(rec);
          await waitForReport(t.samplerId, "the sampler's report widget after the template's run");
          await focusNodes([t.samplerId], 30, 1.0); // near 100 %: a zoomed-out canvas hides DOM widgets
          rec.sampler = await reportState(t.samplerId);
          await shot("template_ran");
        }
      });
    }

    h.stageName = "end";
    results.finished = true;
  } finally {
    save();
    await h.context.close().catch(() => {});
  }
}

h.run(main, 900);
