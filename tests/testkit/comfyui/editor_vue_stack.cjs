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

const { harness } = require("./editor_harness.cjs");

const h = harness("editor_vue_stack.cjs");
const { cfg, T, results, save, note, ensure, shot, stage, waitFor, settle, dropFile, queueFromUi } = h;
let page; // h.page, once main has opened the browser

const VUE_SETTING = "Comfy.VueNodes.Enabled";

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

async function main() {
  page = await h.open();
  try {
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
      await queueFromUi(rec, { fallback: false });
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
    await h.context.close().catch(() => {});
  }
}

h.run(main, 1200, () => {
  results.finished = results.finished || results.available === false || !!results.skipped;
});
