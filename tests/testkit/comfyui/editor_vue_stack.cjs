// The LoRA Stack in the Vue node renderer ("Nodes 2.0", Comfy.VueNodes.Enabled), driven the way a
// user does, for tests/integration/test_browser.py:
//
//   node editor_vue_stack.cjs CONFIG.json RESULTS.json
//
// CONFIG (written by the test): url, chromium, playwrightDir, userDataDir, fontconfigFile,
// screenshotDir, workflow {path, name, expected}, stackId, samplerId, timeouts {action, load, run},
// hardStopSeconds, minFrontend {version, reason} (older frontends: results.skipped, nothing run).
// `expected` is {nodeId: {type, widgets_values}}.
//
// Stages, each recorded in RESULTS (a failed stage keeps its error and a screenshot; the test asserts):
//   load    - the editor; whether this frontend has the Vue renderer at all (results.available);
//   vue     - the setting on, the stack workflow dropped on the canvas: every node is a Vue node and
//             the stack's rows are its widgets there;
//   rows    - through the Vue node's own controls: + Add LoRA, the on/off toggle (off and on again),
//             ✕ remove on a row that has a different row after it; after each step the `rows` JSON,
//             the widgets' values and what the node shows;
//   run     - the Run button; the sampler's report and the stack's coverage inside their Vue nodes.
// Nothing outside 127.0.0.1 is reachable (every other request is aborted).
"use strict";

const fs = require("fs");
const path = require("path");

const [, , configPath, resultsPath] = process.argv;
if (!configPath || !resultsPath) {
  console.error("usage: node editor_vue_stack.cjs CONFIG.json RESULTS.json");
  process.exit(2);
}
const cfg = JSON.parse(fs.readFileSync(configPath, "utf-8"));
const T = Object.assign({ action: 30000, load: 120000, run: 300000 }, cfg.timeouts || {});
const pw = require(cfg.playwrightDir);

const VUE_SETTING = "Comfy.VueNodes.Enabled";
const results = {
  started: new Date().toISOString(), finished: false, versions: {}, available: null, stages: {}, console: [],
  consoleStacks: [], pageErrors: [], blockedRequests: [], screenshots: [], log: [],
};
let page;
let shots = 0;
let currentStage = "start";

const save = () => fs.writeFileSync(resultsPath, JSON.stringify(results, null, 1));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function note(msg) {
  const line = `${new Date().toISOString().slice(11, 23)} ${msg}`;
  results.log.push(line);
  console.log(line);
}

function ensure(cond, msg) {
  if (!cond) throw new Error(msg);
}

async function shot(name) {
  shots += 1;
  const file = path.join(cfg.screenshotDir, `${String(shots).padStart(2, "0")}_${name}.png`);
  try {
    await page.screenshot({ path: file, timeout: T.action });
    results.screenshots.push({ name, path: file });
  } catch (e) {
    results.screenshots.push({ name, path: null, error: String(e) });
  }
}

async function stage(name, fn) {
  const rec = { ok: false };
  results.stages[name] = rec;
  currentStage = name;
  note(`stage ${name}: start`);
  const t0 = Date.now();
  try {
    await fn(rec);
    rec.ok = true;
  } catch (e) {
    rec.error = String(e && e.stack ? e.stack : e);
    note(`stage ${name}: FAILED ${String(e).split("\n")[0]}`);
    await shot(`${name}_failed`);
  }
  rec.seconds = (Date.now() - t0) / 1000;
  save();
  return rec.ok;
}

async function waitFor(desc, fn, arg, timeout = T.action) {
  try {
    return await page.waitForFunction(fn, arg, { timeout, polling: 250 });
  } catch (e) {
    throw new Error(`timed out after ${timeout} ms waiting for ${desc}`);
  }
}

async function settle(ms = 600) {
  await page.evaluate(() => window.app.canvas.setDirty(true, true));
  await sleep(ms);
  await page.evaluate(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))));
}

/**
 * The canvas at `scale` (less where the nodes would not fit) with the given nodes' box in the middle
 * (Vue nodes follow its transform). Twice: a Vue node's height depends on the zoom it was measured at
 * (1.27 draws fewer details far out), so the second pass measures it at about the final zoom.
 */
async function focusNodes(ids, scale = 1.0) {
  await focusOnce(ids, scale);
  await focusOnce(ids, scale);
}

async function focusOnce(ids, scale) {
  await page.evaluate((a) => {
    const c = window.app.canvas;
    const th = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
    let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
    for (const id of a.ids) {
      const n = window.app.graph.getNodeById(id);
      if (!n) continue;
      // a Vue node may be taller than node.size (1.27 draws its widgets larger)
      const vue = document.querySelector(`[data-node-id="${id}"]`);
      const h = Math.max(n.size[1], vue ? vue.getBoundingClientRect().height / c.ds.scale - th : 0);
      x0 = Math.min(x0, n.pos[0]);
      y0 = Math.min(y0, n.pos[1] - th);
      x1 = Math.max(x1, n.pos[0] + n.size[0]);
      y1 = Math.max(y1, n.pos[1] + h);
    }
    const cw = c.canvas.clientWidth;
    const ch = c.canvas.clientHeight;
    const s = Math.min(a.scale, (cw - 60) / (x1 - x0), (ch - 60) / (y1 - y0));
    c.ds.scale = s;
    c.ds.offset[0] = (cw / s - (x1 - x0)) / 2 - x0;
    c.ds.offset[1] = (ch / s - (y1 - y0)) / 2 - y0;
    c.setDirty(true, true);
  }, { ids, scale });
  await settle();
}

/** Drop a file on the canvas the way the OS does when a user drags one in. */
async function dropFile(filePath, name, mime) {
  const b64 = fs.readFileSync(filePath).toString("base64");
  return page.evaluate(async (a) => {
    const bin = atob(a.b64);
    const bytes = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i += 1) bytes[i] = bin.charCodeAt(i);
    const dt = new DataTransfer();
    dt.items.add(new File([bytes], a.name, { type: a.mime }));
    const target = window.app.canvasEl || document.querySelector("#graph-canvas");
    const r = target.getBoundingClientRect();
    const at = { clientX: r.x + 20, clientY: r.y + 20, bubbles: true, cancelable: true, dataTransfer: dt };
    const log = [];
    for (const type of ["dragenter", "dragover", "drop"]) {
      log.push({ type, defaultPrevented: !target.dispatchEvent(new DragEvent(type, at)) });
    }
    return log;
  }, { b64, name, mime });
}

// ------------------------------------------------------------------ what the stack shows

/**
 * The stack node's state: the `rows` JSON it will send, its row widgets' values, and what its Vue
 * element shows for each widget (label, and the value each control displays: the pressed button or
 * the checked switch of a toggle, a combo's text, an input's value).
 */
function pageStackState(id) {
  const WIDGET_ELEMENTS = '[data-testid="node-widget"], .lg-widget-container'; // 1.49+, 1.27
  const n = window.app.graph.getNodeById(id);
  const host = document.querySelector(`[data-node-id="${id}"]`);
  const rowsWidget = (n.widgets || []).find((w) => w.name === "rows");
  // each widget element of the Vue node, named (1.58: data-widget-name; 1.49 and 1.27: its label or
  // button text) in data-lora-it-name, which clickWidget's locator uses
  const named = (host ? [...host.querySelectorAll(WIDGET_ELEMENTS)] : []).map((el) => {
    const label = el.querySelector('[data-testid="widget-layout-field-label"], label, p');
    const button = el.querySelector("button");
    const name = el.dataset.widgetName || (label && label.innerText.trim())
      || (button && button.innerText.trim()) || "";
    el.setAttribute("data-lora-it-name", name);
    return el;
  });
  const shown = named.map((el) => {
    const pressed = el.querySelector('[aria-pressed="true"]');
    const sw = el.querySelector('[role="switch"], input[type="checkbox"]');
    const input = el.querySelector("input:not([type=checkbox]), textarea");
    const combo = el.querySelector('[role="combobox"]');
    let value = null;
    if (pressed) value = pressed.innerText.trim();
    else if (sw) value = sw.getAttribute("aria-checked") ?? String(!!sw.checked);
    else if (combo) value = combo.innerText.trim();
    else if (input) value = input.value;
    return { name: el.getAttribute("data-lora-it-name"), value, text: el.innerText.replace(/\s+/g, " ").trim() };
  });
  return {
    rows: rowsWidget ? rowsWidget.value : null,
    widgets: (n.widgets || []).map((w) => ({ name: w.name, type: w.type,
      value: w.value !== null && typeof w.value === "object" ? null : w.value })),
    shown,
    size: [Math.round(n.size[0]), Math.round(n.size[1])],
    vueRect: host ? (({ width, height }) => ({ w: Math.round(width), h: Math.round(height) }))(
      host.getBoundingClientRect()) : null,
  };
}

async function stackState() {
  return page.evaluate(pageStackState, cfg.stackId);
}

/** The report element inside a Vue node: its lines, and whether it is shown. */
function pageVueReport(id) {
  const host = document.querySelector(`[data-node-id="${id}"]`);
  const n = window.app.graph.getNodeById(id);
  const bodies = host ? [...host.querySelectorAll(".lora-runtime-report > div")] : [];
  const visible = bodies.filter((b) => {
    const r = b.getBoundingClientRect();
    return b.isConnected && r.width > 0 && r.height > 0 && b.checkVisibility({ checkVisibilityCSS: true });
  });
  const body = visible[0] || null;
  return {
    visibleReports: visible.length,
    lines: body ? [...body.children].map((r) => ({ text: r.textContent, level: r.dataset.level })) : [],
    properties: Object.assign({}, n.properties),
  };
}

/** Click a widget's control inside the stack's Vue node: a button widget, or one side of a toggle. */
async function clickWidget(name, side = null) {
  await focusNodes([cfg.stackId]); // the whole node on screen, as it is now
  await stackState(); // names the widget elements as they are now (data-lora-it-name)
  const w = page.locator(`[data-node-id="${cfg.stackId}"] [data-lora-it-name="${name}"]`).first();
  await w.waitFor({ state: "visible", timeout: T.action });
  if (side === null) {
    await w.locator("button").first().click({ timeout: T.action });
    return `button of ${name}`;
  }
  // a toggle: a switch (click when it is not in the wanted state) or an off / on pair of buttons
  const sw = w.locator('[role="switch"], input[type="checkbox"]').first();
  if ((await sw.count()) > 0) {
    const checked = await sw.evaluate((e) => (e.getAttribute("aria-checked") ?? String(!!e.checked)) === "true");
    if (checked !== (side === "on")) await sw.click({ timeout: T.action });
    return `switch of ${name}`;
  }
  await w.getByRole("button", { name: side, exact: true }).first().click({ timeout: T.action });
  return `${side} button of ${name}`;
}

async function afterEdit(rec, key, desc, want) {
  // the rows JSON first (the model), then the Vue node shows it (re-rendered a moment later)
  await waitFor(`${desc}: rows ${JSON.stringify(want)}`, (a) => {
    const n = window.app.graph.getNodeById(a.id);
    const w = (n.widgets || []).find((x) => x.name === "rows");
    try {
      const rows = JSON.parse(w.value);
      return rows.length === a.want.length && rows.every((r, i) => r.on === a.want[i].on && r.lora === a.want[i].lora);
    } catch {
      return false;
    }
  }, { id: cfg.stackId, want });
  await waitFor(`${desc}: the Vue node shows ${want.length} rows`, (a) => {
    const host = document.querySelector(`[data-node-id="${a.id}"]`);
    const labels = host ? [...host.querySelectorAll('[data-testid="node-widget"], .lg-widget-container')]
      .map((e) => e.innerText.trim()) : [];
    return labels.filter((x) => /^LoRA \d+\b/.test(x)).length === a.n;
  }, { id: cfg.stackId, n: want.length });
  await settle(800);
  rec[key] = await stackState();
  await shot(`vue_stack_${key}`);
}

// ------------------------------------------------------------------ the run

async function queueFromUi(rec) {
  const mark = await page.evaluate(() => window.__loraIT.events.length);
  const selectors = ['[data-testid="queue-button"] button.p-splitbutton-button',
    '[data-testid="queue-button"] button[aria-label="Run"]', 'button[data-testid="queue-button"]',
    "button#queue-button"];
  rec.queuedVia = null;
  for (const sel of selectors) {
    const loc = page.locator(sel).first();
    if ((await loc.count()) === 0) continue;
    try {
      await loc.click({ timeout: 10000 });
      rec.queuedVia = `click ${sel}`;
      break;
    } catch (e) {
      rec.clickError = String(e).split("\n")[0];
    }
  }
  ensure(rec.queuedVia, `no clickable Run button (${rec.clickError || "none found"})`);
  const h = await page.waitForFunction((m) => {
    const evs = window.__loraIT.events.slice(m);
    const start = evs.find((e) => e.type === "execution_start");
    const end = evs.find((e) => start && e.prompt_id === start.prompt_id
      && ["execution_success", "execution_error", "execution_interrupted"].includes(e.type));
    if (end) return { end: end.type, prompt_id: end.prompt_id, detail: end.detail || null };
    const errs = window.app.lastNodeErrors;
    if (errs && Object.keys(errs).length) return { end: "node_errors", detail: errs };
    return false;
  }, mark, { timeout: T.run, polling: 250 });
  const outcome = await h.jsonValue();
  rec.promptId = outcome.prompt_id || null;
  rec.outcome = outcome.end;
  ensure(outcome.end === "execution_success",
    `the queued prompt ended with ${outcome.end}: ${JSON.stringify(outcome.detail).slice(0, 1500)}`);
}

async function main() {
  fs.mkdirSync(cfg.screenshotDir, { recursive: true });
  const context = await pw.chromium.launchPersistentContext(cfg.userDataDir, {
    executablePath: cfg.chromium, headless: true, timeout: T.load, viewport: { width: 1600, height: 1000 },
    deviceScaleFactor: 1,
    env: cfg.fontconfigFile ? { ...process.env, FONTCONFIG_FILE: cfg.fontconfigFile } : process.env,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const browser = context.browser();
  results.versions.chromium = browser ? browser.version() : null;
  try {
    page = context.pages()[0] || (await context.newPage());
    page.setDefaultTimeout(T.action);
    const origin = new URL(cfg.url).origin;
    await context.route("**/*", (route) => {
      const u = route.request().url();
      if (u.startsWith(origin) || u.startsWith("data:") || u.startsWith("blob:")) return route.continue();
      results.blockedRequests.push(u);
      return route.abort("blockedbyclient");
    });
    page.on("console", (m) => {
      const loc = m.location() || {};
      results.console.push({ type: m.type(), text: m.text(), url: loc.url || "", stage: currentStage });
    });
    page.on("pageerror", (e) => results.pageErrors.push({ message: e.message, stack: e.stack || "",
      stage: currentStage }));
    try {
      const cdp = await context.newCDPSession(page);
      cdp.on("Runtime.consoleAPICalled", (e) => {
        if (e.type !== "error" && e.type !== "warning") return;
        results.consoleStacks.push({ type: e.type, stage: currentStage,
          text: (e.args || []).map((a) => (a.value !== undefined ? String(a.value) : a.description || "")).join(" "),
          frames: ((e.stackTrace && e.stackTrace.callFrames) || []).map((f) => ({ url: f.url, fn: f.functionName })) });
      });
      await cdp.send("Runtime.enable");
    } catch (e) {
      results.consoleStacks = null;
    }

    const loaded = await stage("load", async (rec) => {
      await page.goto(cfg.url, { waitUntil: "domcontentloaded", timeout: T.load });
      await waitFor("the editor", () => window.app && window.app.graph && window.app.canvas && window.app.vueAppReady
        && window.app.extensionManager && window.app.extensionManager.setting, null, T.load);
      await settle(1000);
      rec.frontendVersion = await page.evaluate(() => window.__COMFYUI_FRONTEND_VERSION__ || null);
      results.versions.frontend = rec.frontendVersion;
      results.available = await page.evaluate((s) => window.app.extensionManager.setting.get(s) !== undefined,
        VUE_SETTING);
      await page.evaluate(() => {
        window.__loraIT = { events: [] };
        for (const t of ["execution_start", "execution_success", "execution_error", "execution_interrupted",
          "executed"]) {
          window.app.api.addEventListener(t, (e) => {
            const d = e.detail || {};
            window.__loraIT.events.push({ type: t, prompt_id: d.prompt_id, node: d.display_node ?? d.node ?? null,
              detail: t === "execution_error" ? d : undefined });
          });
        }
      });
    });
    if (!loaded || !results.available) return;
    const older = (v, min) => {
      const a = String(v || "0").split(".").map(Number);
      const b = String(min).split(".").map(Number);
      for (let i = 0; i < Math.max(a.length, b.length); i += 1) {
        if ((a[i] || 0) !== (b[i] || 0)) return (a[i] || 0) < (b[i] || 0);
      }
      return false;
    };
    if (cfg.minFrontend && older(results.versions.frontend, cfg.minFrontend.version)) {
      results.skipped = `frontend ${results.versions.frontend}: ${cfg.minFrontend.reason}`;
      return;
    }

    const shown = await stage("vue", async (rec) => {
      // dropped first, then the renderer switched on (frontend 1.27's Vue layer does not follow a
      // graph loaded while it is on: it keeps the previous graph's nodes)
      await page.evaluate(() => window.app.graph.clear());
      rec.dispatch = await dropFile(cfg.workflow.path, cfg.workflow.name, "application/json");
      const ids = Object.keys(cfg.workflow.expected).map(Number);
      await waitFor("the stack workflow's nodes", (a) => a.ids.every((id) => window.app.graph.getNodeById(id))
        && window.app.graph.nodes.length === a.ids.length, { ids });
      rec.enabledValue = await page.evaluate(async (s) => {
        await window.app.extensionManager.setting.set(s, true);
        return window.app.extensionManager.setting.get(s);
      }, VUE_SETTING);
      await waitFor("every node of the stack workflow as a Vue node", (a) => a.ids.every(
        (id) => window.app.graph.getNodeById(id) && document.querySelector(`[data-node-id="${id}"]`)), { ids });
      await focusNodes([cfg.stackId]);
      rec.nodeTypes = await page.evaluate(() => window.app.graph.nodes.map((n) => n.type));
      rec.vueNodeCount = await page.evaluate(() => document.querySelectorAll("[data-node-id]").length);
      rec.stack = await stackState();
      await shot("vue_stack_loaded");
    });
    if (!shown) return;

    // the saved workflow: [style on, distilled off]
    const rows = await stage("rows", async (rec) => {
      // room under the stack for a third row, as a user drags the node below away (1.27's Vue nodes are
      // taller than their saved size and cover the node below: clicks would land on that node)
      rec.movedBelow = await page.evaluate((a) => {
        const c = window.app.canvas;
        const th = (window.LiteGraph && window.LiteGraph.NODE_TITLE_HEIGHT) || 30;
        const s = window.app.graph.getNodeById(a.id);
        const el = document.querySelector(`[data-node-id="${a.id}"]`);
        const bottom = s.pos[1] - th + Math.max(s.size[1] + th, el.getBoundingClientRect().height / c.ds.scale) + a.room;
        const moved = [];
        for (const n of window.app.graph.nodes) {
          if (n === s || n.pos[1] <= s.pos[1]) continue;
          if (n.pos[0] >= s.pos[0] + s.size[0] || n.pos[0] + n.size[0] <= s.pos[0]) continue;
          if (n.pos[1] - th >= bottom) continue;
          moved.push({ id: n.id, from: [n.pos[0], n.pos[1]] });
          n.pos = [n.pos[0], bottom + th];
        }
        c.setDirty(true, true);
        return moved;
      }, { id: cfg.stackId, room: 400 });
      await settle();
      const [a, b] = JSON.parse((await stackState()).rows).map((r) => r.lora);
      rec.clicks = [];
      rec.clicks.push(await clickWidget("+ Add LoRA"));
      await afterEdit(rec, "added", "+ Add LoRA", [{ on: true, lora: a }, { on: false, lora: b }, { on: true, lora: b }]);
      rec.clicks.push(await clickWidget("LoRA 1", "off"));
      await afterEdit(rec, "toggledOff", "row 1 off", [{ on: false, lora: a }, { on: false, lora: b }, { on: true, lora: b }]);
      rec.clicks.push(await clickWidget("LoRA 1", "on"));
      await afterEdit(rec, "toggledOn", "row 1 on", [{ on: true, lora: a }, { on: false, lora: b }, { on: true, lora: b }]);
      // row 2 (off) goes; row 3 (on) becomes row 2 and must show as on
      rec.clicks.push(await clickWidget("\u2715 remove LoRA 2"));
      await afterEdit(rec, "removed", "remove row 2", [{ on: true, lora: a }, { on: true, lora: b }]);
      rec.promptRows = await page.evaluate(async (id) => (await window.app.graphToPrompt()).output[String(id)].inputs.rows,
        cfg.stackId);
    });
    if (!rows) return;

    await stage("run", async (rec) => {
      await queueFromUi(rec);
      for (const [key, id, property] of [["sampler", cfg.samplerId, "lora_runtime_report"],
        ["stack", cfg.stackId, "lora_coverage"]]) {
        await waitFor(`the report inside Vue node ${id}`, (a) => {
          const host = document.querySelector(`[data-node-id="${a.id}"]`);
          const body = host && host.querySelector(".lora-runtime-report > div");
          const n = window.app.graph.getNodeById(a.id);
          return !!body && body.isConnected && body.children.length > 0 && body.style.display !== "none"
            && typeof n.properties[a.property] === "string";
        }, { id, property });
        await focusNodes([cfg.stackId, cfg.samplerId]);
        rec[key] = await page.evaluate(pageVueReport, id);
      }
      rec.stackAfter = await stackState();
      await shot("vue_stack_report_after_run");
    });
    results.finished = true;
  } finally {
    save();
    await context.close().catch(() => {});
  }
}

const hardStop = setTimeout(() => {
  results.error = `driver hard stop after ${cfg.hardStopSeconds} s`;
  save();
  process.exit(3);
}, (cfg.hardStopSeconds || 900) * 1000);

main()
  .then(() => {
    clearTimeout(hardStop);
    results.finished = results.finished || results.available === false || !!results.skipped;
    save();
    process.exit(0);
  })
  .catch((e) => {
    clearTimeout(hardStop);
    results.error = String(e && e.stack ? e.stack : e);
    save();
    console.error(results.error);
    process.exit(1);
  });
