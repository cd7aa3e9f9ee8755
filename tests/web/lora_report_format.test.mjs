import assert from "node:assert/strict";
import { test } from "node:test";

import { fullReport, tree } from "../testkit/web/harness.mjs";

const fmt = await import(tree().format);

test("full report: ordered badges with decision, adapters, warning, fusions, settings, timings", () => {
  const items = fmt.formatReport(fullReport());
  assert.deepEqual(items.map((i) => i.key), [
    "decision", "adapter:0", "adapter:1", "coverage-warning", "fusions", "settings", "timings",
  ]);
  for (const i of items) {
    assert.equal(typeof i.text, "string");
    assert.ok(i.text.length > 0);
    assert.ok(["ok", "warn", "error", "info"].includes(i.level), i.level);
    assert.equal(typeof i.title, "string");
  }
  const byKey = Object.fromEntries(items.map((i) => [i.key, i]));
  assert.equal(byKey.decision.text, "dynamic — a merge would lose 78 %");
  assert.match(byKey.decision.title, /round away 78%/);
  assert.equal(byKey["adapter:0"].level, "ok");
  assert.equal(byKey["adapter:0"].text, "240/240 layers · style ×0.8 (kohya)");
  assert.equal(byKey["adapter:1"].level, "warn");
  assert.equal(byKey["adapter:1"].text, "100/120 layers, 20 not loaded · partial ×1.0");
  assert.equal(byKey["coverage-warning"].level, "warn");
  assert.match(byKey["coverage-warning"].text, /1 adapter only partly loaded/);
  assert.match(byKey["coverage-warning"].title, /text_encoder\.layers\.0\.q_proj/);
  assert.equal(byKey.fusions.text, "fused kernels on 2 sites, 1 skipped");
  assert.match(byKey.fusions.title, /blocks\.0\.mlp: linear_gelu_tanh \(calls: base_fused 40, unfused 0\)/);
  assert.match(byKey.fusions.title, /bias missing/);
  assert.equal(byKey.settings.text, "tier lossless · mode auto · comfy host");
  assert.equal(byKey.timings.text, "patch 0.12 s · 1.23 s/step");
  assert.match(byKey.timings.title, /3\.0 MiB/);
});

test("partial coverage is a warning whose title lists the unmatched examples", () => {
  const c = fmt.formatCoverage({
    adapter: "a.safetensors", format: "kohya", matched: 10, file_layers: 12, model_linears: 50,
    unmatched: 5, unmatched_examples: ["lora_te_x (text encoder)", "lora_unet_y (no such layer)"],
  });
  assert.equal(c.level, "warn");
  assert.equal(c.text, "10/12 layers, 5 not loaded · a");
  assert.match(c.title, /lora_te_x \(text encoder\)/);
  assert.match(c.title, /lora_unet_y \(no such layer\)/);
  assert.match(c.title, /… and 3 more/);
  // matched < file_layers without an unmatched count is partial too
  assert.equal(fmt.formatCoverage({ adapter: "b", matched: 3, file_layers: 4 }).level, "warn");
});

test("zero matched is an error", () => {
  const c = fmt.formatCoverage({ adapter: "z.safetensors", matched: 0, file_layers: 64, unmatched: 64,
    unmatched_examples: ["x (y)"] });
  assert.equal(c.level, "error");
  assert.match(c.text, /0\/64 layers matched/);
  assert.match(c.title, /x \(y\)/);
  const items = fmt.formatCoverageList([{ adapter: "z", matched: 0, file_layers: 3, unmatched: 3 }]);
  assert.equal(items.at(-1).key, "coverage-warning");
  assert.equal(items.at(-1).level, "error");
});

test("full coverage is ok; coverage list of the loader node", () => {
  const ok = fmt.formatCoverage({ adapter: "ok", format: "peft", matched: 8, file_layers: 8, unmatched: 0 });
  assert.equal(ok.level, "ok");
  assert.equal(ok.text, "8/8 layers · ok (peft)");
  const items = fmt.formatCoverageList([{ adapter: "ok", matched: 8, file_layers: 8, unmatched: 0 }]);
  assert.equal(items.length, 1);
});

test("decision texts and shares", () => {
  assert.equal(fmt.formatShare(0.78), "78 %");
  assert.equal(fmt.formatShare(0.03), "3 %");
  assert.equal(fmt.formatShare(0.001), "< 1 %");
  assert.equal(fmt.formatShare(0), "0 %");
  assert.equal(fmt.formatShare(null), null);
  assert.equal(fmt.formatDecision({ requested: "auto", chosen: "merge", share_lost: 0.03 }).text, "merged (3 % lost)");
  assert.equal(fmt.formatDecision({ requested: "dynamic", chosen: "dynamic", share_lost: null }).text,
    "dynamic (requested)");
  assert.equal(fmt.formatDecision({ requested: "merge", chosen: "merge" }).text, "merged (requested)");
  assert.equal(fmt.formatDecision({ requested: "auto", chosen: "dynamic", share_lost: null,
    reason: "3 layers cannot take a merge" }).text, "dynamic — layers cannot take a merge");
  const cached = fmt.formatDecision({ requested: "auto", chosen: "dynamic", share_lost: 0.9, cached: true,
    threshold: 0.5 });
  assert.match(cached.title, /cache/);
  assert.match(cached.title, /above 50 %/);
});

test("shared decision cache: hits in the hover, an ignored entry as a warning", () => {
  const shared = fmt.formatDecision({ requested: "auto", chosen: "merge", share_lost: 0.2, cached: true,
    measured: 0, shared_cache: 2 });
  assert.equal(shared.level, "ok");
  assert.match(shared.title, /decision from the shared cache for 2 adapter\(s\)/);
  const note = "shared decision cache entry share-ab.json in /c is not complete JSON (truncated or corrupt): " +
    "ignored, measured again";
  const ignored = fmt.formatDecision({ requested: "auto", chosen: "merge", share_lost: 0.2, measured: 1,
    cache_notes: [note, 3] });
  assert.equal(ignored.level, "warn");
  assert.match(ignored.text, /shared cache entry ignored$/);
  assert.ok(ignored.title.includes(note));
});

test("null decision: no adapter applied", () => {
  const d = fmt.formatDecision(null);
  assert.equal(d.text, "no adapter applied");
  assert.equal(d.level, "info");
  const items = fmt.formatReport({ host: "comfy", mode_requested: "auto", tier: "exact", decision: null,
    adapters: [], fusions: { mounted: 0, sites: [], skipped: 0, skip_reasons: [] }, patch_seconds: 0,
    restore_bytes: 0, sample_seconds: 1, seconds_per_step: 0.05 });
  assert.equal(items[0].text, "no adapter applied");
  assert.ok(!items.some((i) => i.key === "coverage-warning"));
  assert.equal(items.find((i) => i.key === "fusions").text, "no fused kernels");
  assert.equal(items.find((i) => i.key === "timings").text, "patch 0 ms · 0.05 s/step");
});

test("missing fields (older reports) degrade instead of failing", () => {
  const items = fmt.formatReport({ decision: { chosen: "merge" }, adapters: [{ name: "old.safetensors" }] });
  assert.deepEqual(items.map((i) => i.key), ["decision", "adapter:0", "coverage-warning"]);
  assert.equal(items[0].text, "merged");
  assert.equal(items[1].text, "coverage not reported · old");
  assert.equal(items[1].level, "warn");
  // raw ApplyReport-style fusions list
  const f = fmt.formatFusions([{ site: "a", fusions: ["x"], routes: {} }, { site: "b", fusions: [], skipped: "why" }]);
  assert.equal(f.text, "fused kernels on 1 site, 1 skipped");
  assert.match(f.title, /why/);
  assert.equal(fmt.formatFusions(undefined), null);
  const ran = fmt.formatFusions({ mounted: 1, skipped: 0, skip_reasons: [], sites: [{
    site: "blocks.0.ffn", fusions: ["linear_gelu_tanh"], routes: { lora_fused: 5, base_fused: 3 },
    ran: { "lora_fused:triton": 4, "lora_fused:delta_first": 1, "base_fused:cublaslt": 3 } }] });
  assert.match(ran.title, /ran: triton 4, cublaslt 3, delta_first 1/);
  assert.doesNotMatch(f.title, /ran:/);
  assert.equal(fmt.formatTimings({}), null);
  const dis = fmt.formatReport({ adapters: [{ name: "off", enabled: false, strength: 1, coverage: {} }] });
  assert.equal(dis.find((i) => i.key === "adapter:0").text, "disabled · off ×1.0");
  assert.deepEqual(fmt.formatReport(null), []);
  assert.deepEqual(fmt.formatReport(undefined), []);
});

test("strength 0: the decision and the adapter say off (strength 0), not dynamic", () => {
  const r = { decision: { requested: "auto", chosen: "off", share_lost: null, reason: "off (strength 0)",
    adapters: [{ name: "a.safetensors", chosen: "off", share_lost: null, reason: "off (strength 0)" }] },
  adapters: [{ name: "a.safetensors", strength: 0, coverage: { adapter: "a.safetensors", matched: 4, file_layers: 4,
    unmatched: 0 }, decision: { name: "a.safetensors", chosen: "off", share_lost: null, reason: "off (strength 0)" } }] };
  const items = fmt.formatReport(r);
  assert.equal(items[0].text, "off (strength 0)");
  assert.equal(items.find((i) => i.key === "adapter:0").text, "off (strength 0) · a ×0.0");
});

test("text-encoder layers are named as such on the coverage badge, not as missing layers", () => {
  const c = fmt.formatCoverage({ adapter: "sdxl.safetensors", format: "Wan native", matched: 20, file_layers: 20,
    unmatched: 0, text_encoder_layers: 12, text_encoder_tensors: 36 });
  assert.equal(c.level, "ok");
  assert.equal(c.text, "20/20 layers · sdxl (Wan native) · 12 text-encoder layers not applied");
  assert.match(c.title, /12 text-encoder layers \(36 tensors\) not applied: this node patches the model only/);
});

test("torch.compile: a recompile-limit fallback is a warning naming the functions; graphs built are info", () => {
  const fb = { graphs_compiled: 0, message: "torch.compile hit its recompile_limit on 1 function; ...",
    fallbacks: [{ function: "'forward' (wan.py:10)", limit: "recompile_limit", value: 8 }] };
  const items = fmt.formatReport({ decision: { chosen: "dynamic" }, adapters: [], compile: fb });
  const c = items.find((i) => i.key === "compile");
  assert.equal(c.level, "warn");
  assert.equal(c.text, "⚠ torch.compile gave up on 1 function (recompile_limit)");
  assert.match(c.title, /'forward' \(wan.py:10\)/);
  const g = fmt.formatCompile({ graphs_compiled: 2, fallbacks: [] });
  assert.equal(g.text, "torch.compile built 2 graphs");
  assert.equal(g.level, "info");
  assert.equal(fmt.formatCompile({ graphs_compiled: 0, fallbacks: [] }), null);
  assert.equal(fmt.formatCompile(undefined), null);
  assert.ok(!fmt.formatReport({ decision: { chosen: "dynamic" }, adapters: [] }).some((i) => i.key === "compile"));
});

test("model + CLIP loader: the CLIP line replaces 'this node patches the model only'", () => {
  const line = "3 text-encoder layers (9 tensors) applied to the CLIP (x1)";
  const c = fmt.formatCoverage({ adapter: "te.safetensors", format: "kohya", matched: 8, file_layers: 8, unmatched: 0,
    text_encoder_layers: 0, text_encoder_tensors: 0, text_encoder_applied_layers: 3, clip: line });
  assert.equal(c.level, "ok");
  assert.equal(c.text, "8/8 layers · te (kohya) · 3 text-encoder layers on the CLIP");
  assert.match(c.title, /applied to the CLIP/);
  assert.doesNotMatch(c.title, /patches the model only/);
  const skipped = fmt.formatCoverage({ adapter: "te.safetensors", matched: 8, file_layers: 8, unmatched: 0,
    text_encoder_layers: 1, text_encoder_tensors: 3, text_encoder_applied_layers: 2, clip: line + "; 1 not" });
  assert.equal(skipped.level, "warn");
  assert.match(skipped.text, /2 text-encoder layers on the CLIP, 1 not applied$/);
  const only = fmt.formatCoverage({ adapter: "te_only.safetensors", matched: 0, file_layers: 0, unmatched: 0,
    text_encoder_layers: 0, text_encoder_applied_layers: 2, clip: "2 text-encoder layers (6 tensors) applied" });
  assert.equal(only.level, "ok");
  assert.equal(only.text, "text encoder only · te_only · 2 text-encoder layers on the CLIP");
});

test("garbage input never throws", () => {
  const cyclic = {};
  cyclic.self = cyclic;
  const hostile = new Proxy({}, { get() { throw new Error("boom"); }, has() { throw new Error("boom"); } });
  const inputs = [undefined, null, 0, 1, NaN, Infinity, "", "text", true, [], [1, 2], {}, cyclic, hostile,
    { decision: "x", adapters: "y", fusions: 3 }, { adapters: [null, 1, "a", { coverage: "no" }] },
    { decision: { share_lost: "0.5", chosen: 7 } }, { fusions: { sites: [null, { fusions: "x" }] } },
    Symbol("s"), () => 1];
  for (const x of inputs) {
    for (const fn of [fmt.formatReport, fmt.formatCoverage, fmt.formatDecision, fmt.formatFusions,
      fmt.formatTimings, fmt.formatCompile, fmt.formatCoverageList, fmt.payloadFromOutput, fmt.summarize, fmt.formatShare,
      fmt.formatSeconds, fmt.formatBytes, fmt.hoverText, fmt.collapsedSummary]) {
      assert.doesNotThrow(() => fn(x), `${fn.name} on ${typeof x}`);
    }
    assert.doesNotThrow(() => fmt.formatPayload("report", x));
    assert.doesNotThrow(() => fmt.formatPayload("coverage", x));
  }
  const r = fmt.formatReport("garbage");
  assert.equal(r.length, 1);
  assert.equal(r[0].level, "warn");
  const h = fmt.formatReport(hostile);
  assert.ok(Array.isArray(h));
});

test("payloadFromOutput reads both nodes' UI outputs", () => {
  const rep = fullReport();
  assert.deepEqual(fmt.payloadFromOutput({ lora_report: [rep] }), { kind: "report", payload: rep });
  const cov = [{ adapter: "a", matched: 1, file_layers: 1 }];
  assert.deepEqual(fmt.payloadFromOutput({ lora_coverage: cov }), { kind: "coverage", payload: cov });
  assert.equal(fmt.payloadFromOutput({ images: [] }), null);
  assert.equal(fmt.payloadFromOutput({ lora_report: [] }), null);
  assert.equal(fmt.summarize(fmt.formatReport(rep)).split(" | ")[0], "dynamic — a merge would lose 78 %");
});

test("hoverText: the whole line first, then its details", () => {
  assert.equal(fmt.hoverText({ text: "a line", title: "" }), "a line");
  assert.equal(fmt.hoverText({ text: "a line", title: "a line" }), "a line");
  assert.equal(fmt.hoverText({ text: "a line", title: "a line: more" }), "a line: more");
  assert.equal(fmt.hoverText({ text: "a line", title: "why" }), "a line\nwhy");
  for (const item of fmt.formatReport(fullReport())) {
    assert.ok(fmt.hoverText(item).startsWith(item.text), item.key);
  }
});

test("collapsedSummary: one line, warnings and errors first, every line in the hover text", () => {
  const items = fmt.formatReport(fullReport());
  const s = fmt.collapsedSummary(items);
  assert.equal(s.count, items.length);
  assert.equal(s.level, "warn");
  // the two warning lines lead, in their order; then the others in theirs
  const warns = items.filter((i) => i.level === "warn").map((i) => i.text);
  const others = items.filter((i) => i.level !== "warn").map((i) => i.text);
  assert.equal(s.text, [...warns, ...others].join(" · "));
  assert.equal(s.title, items.map((i) => i.text).join("\n"));
  const ok = fmt.collapsedSummary([{ key: "a", text: "merged", level: "ok" }, { key: "b", text: "t", level: "info" }]);
  assert.equal(ok.text, "merged · t");
  assert.equal(ok.level, "ok");
  const err = fmt.collapsedSummary([{ text: "x", level: "warn" }, { text: "broken", level: "error" }]);
  assert.ok(err.text.startsWith("broken · x"));
  assert.equal(err.level, "error");
  assert.equal(fmt.collapsedSummary([]), null);
});

test("a scheduled / per-branch adapter says so on its badge and lists the schedule on hover", () => {
  const items = fmt.formatReport({
    decision: { requested: "auto", chosen: "dynamic", share_lost: null, reason: "stays unmerged: schedule" },
    adapters: [{ name: "d.safetensors", strength: 1, coverage: { adapter: "d.safetensors", matched: 3, file_layers: 3 },
      schedule: "keyframes 0:1, 0.5:0", schedule_applied: "steps 1-4 x1, steps 5-8 x0" },
    { name: "p.safetensors", strength: 1, coverage: {}, branch: "positive only" }],
    fusions: { mounted: 0, sites: [], skipped: 0, skip_reasons: [] },
  });
  const a = items.find((i) => i.key === "adapter:0");
  assert.match(a.text, /scheduled/);
  assert.match(a.title, /strength schedule: keyframes 0:1, 0.5:0/);
  assert.match(a.title, /applied: steps 1-4 x1, steps 5-8 x0/);
  assert.match(items.find((i) => i.key === "adapter:1").text, /positive only/);
});

test("coverage title counts keys as keys and lists the update types of non-LoRA files", () => {
  const c = fmt.formatCoverage({
    adapter: "flux.safetensors", format: "Flux diffusers (peft keys)", matched: 57, file_layers: 58,
    model_linears: 40, unmatched: 1, unmatched_examples: ["transformer.x (no such layer in the model)"],
    keys_total: 117, keys_applied: 114, kinds: { sliced: 6, lora: 30, param: 3 },
  });
  assert.equal(c.level, "warn");
  assert.match(c.title, /114\/117 keys of the file applied/);
  assert.match(c.title, /3 keys \(1 layers or keys\) not loaded/);
  assert.match(c.title, /targets by type: 6 sliced, 30 lora, 3 param/);
  const plain = fmt.formatCoverage({ adapter: "a", matched: 2, file_layers: 2, kinds: { lora: 2 } });
  assert.doesNotMatch(plain.title, /targets by type/);
});

test("a block-filtered adapter says so on its badge and lists the layers per strength on hover", () => {
  const items = fmt.formatReport({
    decision: { requested: "auto", chosen: "merge", share_lost: 0, reason: "" },
    adapters: [{ name: "b.safetensors", strength: 0.8, coverage: { adapter: "b.safetensors", matched: 20, file_layers: 20 },
      blocks: { text: "0: 0.5, !cross_attn", excluded: 8, excluded_where: "blocks 0-1",
        strengths: [{ factor: 0.5, layers: 6, where: "blocks 0" }, { factor: 1, layers: 6, where: "blocks 1" }] } },
    { name: "plain.safetensors", strength: 1, coverage: { adapter: "plain.safetensors", matched: 3, file_layers: 3 } }],
    fusions: { mounted: 0, sites: [], skipped: 0, skip_reasons: [] },
  });
  const a = items.find((i) => i.key === "adapter:0");
  assert.match(a.text, /blocks \(8 left out\)/);
  assert.match(a.title, /blocks '0: 0\.5, !cross_attn': 6 layers x0\.5 \(blocks 0\), 6 layers x1 \(blocks 1\); 8 left out \(blocks 0-1\)/);
  const plain = items.find((i) => i.key === "adapter:1");
  assert.doesNotMatch(plain.text, /blocks/);
  assert.doesNotMatch(plain.title, /blocks/);
});

test("a long file name is cut in the middle, after the layer count and the decision; the hover has it whole", () => {
  const name = "glyph_outline_style_diffusers_rank32_epoch0100.safetensors";
  assert.equal(fmt.middleEllipsis("short_name"), "short_name");
  const cut = fmt.middleEllipsis("abcdefghijklmnopqrstuvwxyz0123456789");
  assert.equal(Array.from(cut).length, fmt.MAX_NAME_CHARS);
  assert.ok(cut.startsWith("abcdefghijklmn") && cut.endsWith("3456789") && cut.includes("\u2026"), cut);
  assert.equal(fmt.shortName(name), "glyph_outline_…k32_epoch0100");
  assert.equal(fmt.shortName("x.SAFETENSORS"), "x");
  const r = {
    decision: { requested: "auto", chosen: "merge", share_lost: 0, adapters: [{ name, chosen: "merge", share_lost: 0 }] },
    adapters: [{ name, strength: 1, coverage: { adapter: name, format: "kohya", matched: 32, file_layers: 32 },
      decision: { name, chosen: "merge", share_lost: 0 } },
    { name: "b.safetensors", strength: 0.5, coverage: { adapter: "b.safetensors", matched: 30, file_layers: 32,
      unmatched: 2 }, decision: { name: "b.safetensors", chosen: "dynamic", share_lost: 0.9 } }],
  };
  const items = fmt.formatReport(r);
  const a = items.find((i) => i.key === "adapter:0");
  assert.equal(a.text, "32/32 layers · merged · glyph_outline_…k32_epoch0100 ×1.0 (kohya)");
  assert.ok(fmt.hoverText(a).startsWith(a.text) && fmt.hoverText(a).includes(`${name} ×1.0`));
  assert.equal(items.find((i) => i.key === "adapter:1").text, "30/32 layers, 2 not loaded · dynamic · b ×0.5");
  // the loader node's line: the layer count first, the name cut in the middle, whole on hover
  const cov = fmt.formatCoverage({ adapter: name, format: "kohya", matched: 32, file_layers: 32 });
  assert.equal(cov.text, "32/32 layers · glyph_outline_…k32_epoch0100 (kohya)");
  assert.ok(cov.title.startsWith(name));
  for (const bad of [undefined, null, 3, {}]) assert.equal(typeof fmt.middleEllipsis(bad), "string");
});

test("ran check: layers applied at cast time (info) and layers that did not run (warn) are shown", () => {
  const cast = { handled: "applied at cast time", why: "the host computes this layer from its weight" };
  const items = fmt.formatReport({ ...fullReport(), ran_check: [
    { layer: "blocks.0.ffn.2", ...cast }, { layer: "blocks.1.ffn.2", ...cast }] });
  const r = items.find((i) => i.key === "ran_check");
  assert.equal(r.text, "2 layers applied at cast time");
  assert.equal(r.level, "info");
  assert.match(r.title, /blocks\.1\.ffn\.2/);
  const w = fmt.formatRanCheck([{ layer: "img_emb.proj", handled: "did not run", why: "its weight was not read either" }]);
  assert.equal(w.level, "warn");
  assert.equal(w.text, "⚠ 1 layer did not run");
  assert.equal(fmt.formatRanCheck([]), null);
  assert.equal(fmt.formatRanCheck(undefined), null);
});

test("host_patched: the layers with a ComfyUI patch beside ours, counted, as one badge after the settings", () => {
  const hp = { layers: 6, examples: ["blocks.0.ffn.0", "blocks.1.ffn.0"], why: "ComfyUI patches this weight itself" };
  const item = fmt.formatHostPatched(hp);
  assert.equal(item.text, "6 layers with a ComfyUI patch beside ours (kept dynamic)");
  assert.match(item.title, /ComfyUI patches this weight itself\n  • blocks\.0\.ffn\.0\n  • blocks\.1\.ffn\.0\n  … and 4 more/);
  assert.equal(fmt.formatHostPatched(undefined), null);
  assert.equal(fmt.formatHostPatched({ layers: 0 }), null);
  const keys = fmt.formatReport({ ...fullReport(), host_patched: hp }).map((i) => i.key);
  assert.equal(keys.indexOf("host_patched"), keys.indexOf("settings") + 1);
});

test("layers: groups the host kept from a merge (dynamic VRAM), counted, one badge after host_patched", () => {
  const groups = [
    { what: "streamed (dynamic VRAM): dynamic", layers: 18, why: "ComfyUI casts this weight at every call",
      names: Array.from({ length: 18 }, (_, i) => `blocks.${i}.ffn.0`) },
    { what: "re-staged at every load (dynamic VRAM): dynamic", layers: 2, why: "copied at every load",
      names: ["text_embedding.0", "head.head"] },
    { what: "merged", layers: 3, names: ["a", "b", "c"] },
  ];
  const item = fmt.formatLayers(groups);
  assert.equal(item.text, "18 layers streamed (dynamic VRAM): dynamic · 2 layers re-staged at every load (dynamic VRAM): dynamic");
  assert.match(item.title, /streamed \(dynamic VRAM\): dynamic — ComfyUI casts this weight at every call\n  • blocks\.0\.ffn\.0/);
  assert.match(item.title, /… and 10 more\nre-staged at every load/);
  assert.match(item.title, /  • head\.head$/);
  // the wrong answers: plain outcomes alone, nothing, or junk give no badge; ComfyUI-patched layers are
  // the host_patched badge's, not repeated here
  assert.equal(fmt.formatLayers([{ what: "merged", layers: 3, names: [] }]), null);
  assert.equal(fmt.formatLayers([{ what: "ComfyUI patch beside ours: dynamic", layers: 2, names: ["a", "b"] }]), null);
  assert.equal(fmt.formatLayers(undefined), null);
  assert.equal(fmt.formatLayers("x"), null);
  const report = { ...fullReport(), host_patched: { layers: 1, examples: ["x"], why: "w" }, layers: groups };
  const keys = fmt.formatReport(report).map((i) => i.key);
  assert.equal(keys.indexOf("layers"), keys.indexOf("host_patched") + 1);
});
