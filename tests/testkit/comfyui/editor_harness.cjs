// What the browser-suite drivers (editor_driver.cjs, editor_vue_stack.cjs) share: their command line
// (CONFIG.json RESULTS.json), the results they write, the headless Chromium they open (a fresh profile,
// nothing outside the ComfyUI origin reachable, console / page errors / failed requests recorded with
// the stage they happened in), stages that record their error and a screenshot and let the next stage
// run, the waits, a file dropped on the canvas as the OS drops one, and a prompt queued with the Run
// button. `harness(script)` returns them bound to one page (`h.page`, set by `h.open()`).
"use strict";

const fs = require("fs");
const path = require("path");

const RUN_SELECTORS = [
  '[data-testid="queue-button"] button.p-splitbutton-button',
  '[data-testid="queue-button"] button[aria-label="Run"]',
  "button#queue-button",
  'button[data-testid="queue-button"]', // frontend 1.49: the Run button itself carries the test id
];

function harness(script) {
  const [, , configPath, resultsPath] = process.argv;
  if (!configPath || !resultsPath) {
    console.error(`usage: node ${script} CONFIG.json RESULTS.json`);
    process.exit(2);
  }
  const cfg = JSON.parse(fs.readFileSync(configPath, "utf-8"));
  const T = Object.assign({ action: 30000, load: 120000, run: 300000 }, cfg.timeouts || {});
  const results = {
    started: new Date().toISOString(), finished: false, versions: {}, stages: {}, console: [], consoleStacks: [],
    pageErrors: [], requestFailures: [], badResponses: [], blockedRequests: [], screenshots: [], log: [],
  };
  const h = { cfg, T, results, pw: require(cfg.playwrightDir), page: null, stageName: "start", shots: 0 };

  h.save = () => fs.writeFileSync(resultsPath, JSON.stringify(results, null, 1));
  h.sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  h.ensure = (cond, msg) => {
    if (!cond) throw new Error(msg);
  };
  h.note = (msg) => {
    const line = `${new Date().toISOString().slice(11, 23)} ${msg}`;
    results.log.push(line);
    console.log(line);
  };

  h.shot = async (name, opts = {}) => {
    h.shots += 1;
    const file = path.join(cfg.screenshotDir, `${String(h.shots).padStart(2, "0")}_${name}.png`);
    try {
      await h.page.screenshot({ path: file, timeout: T.action, ...opts });
      results.screenshots.push({ name, path: file });
    } catch (e) {
      results.screenshots.push({ name, path: null, error: String(e) });
    }
    return file;
  };

  /** Run `fn(rec)` as stage `name`: its error and a screenshot recorded, never thrown; true when it passed. */
  h.stage = async (name, fn) => {
    const rec = { ok: false };
    results.stages[name] = rec;
    h.stageName = name;
    h.note(`stage ${name}: start`);
    const t0 = Date.now();
    try {
      await fn(rec);
      rec.ok = true;
    } catch (e) {
      rec.error = String(e && e.stack ? e.stack : e);
      h.note(`stage ${name}: FAILED ${String(e).split("\n")[0]}`);
      await h.shot(`${name}_failed`);
    }
    rec.seconds = (Date.now() - t0) / 1000;
    h.note(`stage ${name}: ${rec.ok ? "ok" : "failed"} in ${rec.seconds.toFixed(1)} s`);
    h.save();
    return rec.ok;
  };

  h.waitFor = async (desc, fn, arg, timeout = T.action) => {
    try {
      return await h.page.waitForFunction(fn, arg, { timeout, polling: 250 });
    } catch (e) {
      throw new Error(`timed out after ${timeout} ms waiting for ${desc}`);
    }
  };

  h.settle = async (ms = 600) => {
    await h.page.evaluate(() => window.app.canvas.setDirty(true, true));
    await h.sleep(ms);
    await h.page.evaluate(() => new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r))));
  };

  /** Drop a file on the canvas the way the OS does when a user drags one in: {target, files, events}. */
  h.dropFile = async (filePath, name, mime) => {
    const b64 = fs.readFileSync(filePath).toString("base64");
    return h.page.evaluate(async (a) => {
      const bin = atob(a.b64);
      const bytes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i += 1) bytes[i] = bin.charCodeAt(i);
      const dt = new DataTransfer();
      dt.items.add(new File([bytes], a.name, { type: a.mime }));
      const target = window.app.canvasEl || document.querySelector("#graph-canvas");
      const r = target.getBoundingClientRect();
      // an empty spot: the canvas' top-left corner area
      const at = { clientX: r.x + 20, clientY: r.y + 20, bubbles: true, cancelable: true, dataTransfer: dt };
      const events = [];
      for (const type of ["dragenter", "dragover", "drop"]) {
        events.push({ type, defaultPrevented: !target.dispatchEvent(new DragEvent(type, at)) });
      }
      return { target: target.id || target.tagName, files: dt.files.length, events };
    }, { b64, name, mime });
  };

  /**
   * Queue the graph with the Run button (`fallback`: app.queuePrompt(0) where no button can be clicked,
   * else that is an error) and wait for the end of the prompt it started; an error unless it succeeded.
   * Records queuedVia, promptId, outcome and the executed nodes in `rec`; returns the prompt id.
   */
  h.queueFromUi = async (rec, { fallback = true } = {}) => {
    const page = h.page;
    const mark = await page.evaluate(() => window.__loraIT.events.length);
    rec.queuedVia = null;
    for (const sel of RUN_SELECTORS) {
      const loc = page.locator(sel).first();
      if ((await loc.count()) === 0) continue;
      try {
        await loc.click({ timeout: 10000 });
        rec.queuedVia = `click ${sel}`;
        await page.mouse.move(800, 140).catch(() => {}); // off the button (empty canvas): no tooltip in the screenshots
        break;
      } catch (e) {
        rec.clickError = String(e).split("\n")[0];
      }
    }
    if (!rec.queuedVia) {
      h.ensure(fallback, `no clickable Run button (${rec.clickError || "none found"})`);
      await page.evaluate(() => window.app.queuePrompt(0));
      rec.queuedVia = "app.queuePrompt(0) (no Run button found)";
    }
    h.note(`queued via ${rec.queuedVia}`);
    let outcome;
    try {
      const handle = await page.waitForFunction(
        (m) => {
          const evs = window.__loraIT.events.slice(m);
          const start = evs.find((e) => e.type === "execution_start");
          const end = evs.find((e) => start && e.prompt_id === start.prompt_id
            && ["execution_success", "execution_error", "execution_interrupted"].includes(e.type));
          if (end) return { end: end.type, prompt_id: end.prompt_id, detail: end.detail || null };
          const errs = window.app.lastNodeErrors;
          if (errs && Object.keys(errs).length) return { end: "node_errors", detail: errs };
          const dlg = [...document.querySelectorAll(".p-dialog")].map((d) => d.innerText).join("\n");
          if (/failed validation|Prompt execution failed/i.test(dlg)) return { end: "dialog", detail: dlg.slice(0, 2000) };
          return false;
        },
        mark,
        { timeout: T.run, polling: 250 },
      );
      outcome = await handle.jsonValue();
    } catch (e) {
      throw new Error(`no end of the queued prompt within ${T.run} ms`);
    }
    rec.promptId = outcome.prompt_id || null;
    rec.outcome = outcome.end;
    if (outcome.end !== "execution_success") {
      rec.outcomeDetail = outcome.detail;
      throw new Error(`the queued prompt ended with ${outcome.end}: ${JSON.stringify(outcome.detail).slice(0, 1500)}`);
    }
    rec.executedNodes = await page.evaluate(
      (a) => window.__loraIT.events.slice(a.m).filter((e) => e.type === "executed" && e.prompt_id === a.pid)
        .map((e) => String(e.node)),
      { m: mark, pid: rec.promptId },
    );
    return rec.promptId;
  };

  /** Headless Chromium on a fresh profile with the listeners above; sets and returns `h.page`. */
  h.open = async () => {
    fs.mkdirSync(cfg.screenshotDir, { recursive: true });
    // a fresh profile (the test passes an empty temp folder) with the flags that work as root here
    const context = await h.pw.chromium.launchPersistentContext(cfg.userDataDir, {
      executablePath: cfg.chromium,
      headless: true,
      timeout: T.load,
      viewport: { width: 1600, height: 1000 },
      deviceScaleFactor: 1,
      // the test's fontconfig file: DejaVu Sans as the only sans font (ComfyUI's "Arial" falls back to it)
      env: cfg.fontconfigFile ? { ...process.env, FONTCONFIG_FILE: cfg.fontconfigFile } : process.env,
      args: [
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
      ],
    });
    h.context = context;
    const browser = context.browser();
    results.versions.chromium = browser ? browser.version() : null;
    const page = context.pages()[0] || (await context.newPage());
    h.page = page;
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
      results.console.push({ type: m.type(), text: m.text(), url: loc.url || "", line: loc.lineNumber ?? null,
        stage: h.stageName });
    });
    // where each console error / warning was logged from (the whole JS stack; Playwright gives only
    // the call site): the tests tell the core's own messages from ones our extension caused
    try {
      const cdp = await context.newCDPSession(page);
      cdp.on("Runtime.consoleAPICalled", (e) => {
        if (e.type !== "error" && e.type !== "warning") return;
        results.consoleStacks.push({
          type: e.type,
          text: (e.args || []).map((a) => (a.value !== undefined ? String(a.value) : a.description || "")).join(" "),
          frames: ((e.stackTrace && e.stackTrace.callFrames) || []).map((f) => ({ url: f.url, fn: f.functionName,
            line: f.lineNumber })),
          stage: h.stageName,
        });
      });
      await cdp.send("Runtime.enable");
    } catch (e) {
      results.consoleStacks = null;
      h.note(`no console stacks: ${String(e).split("\n")[0]}`);
    }
    page.on("pageerror", (e) => results.pageErrors.push({ message: e.message, stack: e.stack || "",
      stage: h.stageName }));
    page.on("requestfailed", (r) => results.requestFailures.push({ url: r.url(),
      error: (r.failure() || {}).errorText || "", stage: h.stageName }));
    page.on("response", (r) => {
      if (r.status() >= 400) results.badResponses.push({ status: r.status(), url: r.url(), stage: h.stageName });
    });
    return page;
  };

  /**
   * Run `main`, then write the results and exit: 0 when main returned (`done` may mark results first),
   * 1 with its error, 3 past `hardStopSeconds` (the config's, else the default given).
   */
  h.run = (main, defaultHardStopSeconds, done = () => {}) => {
    const hardStop = setTimeout(() => {
      results.error = `driver hard stop after ${cfg.hardStopSeconds || defaultHardStopSeconds} s`;
      h.save();
      process.exit(3);
    }, (cfg.hardStopSeconds || defaultHardStopSeconds) * 1000);
    main()
      .then(() => {
        clearTimeout(hardStop);
        done();
        h.save();
        process.exit(0);
      })
      .catch((e) => {
        clearTimeout(hardStop);
        results.error = String(e && e.stack ? e.stack : e);
        h.save();
        console.error(results.error);
        process.exit(1);
      });
  };

  return h;
}

module.exports = { harness };
