// Pure formatting of the LoRA runtime reports for the node UI.
//
// No DOM, no ComfyUI imports: every function takes the plain JSON the nodes send
// (see nodes/report.py and CoverageReport.to_dict) and returns text badges
// {key, text, level, title}. level is "ok" | "warn" | "error" | "info".
// Every exported function accepts anything (older reports, missing fields,
// garbage) and never throws.

const MAX_TITLE_SITES = 12;
// A file name on a line is cut in the middle past this many characters (head … tail): the line
// starts with the layer count and the decision, and a line cut at the node's edge keeps them.
export const MAX_NAME_CHARS = 28;

function isObj(v) {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

function num(v) {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

function str(v, fallback = "") {
  if (typeof v === "string") return v;
  if (typeof v === "number" && Number.isFinite(v)) return String(v);
  return fallback;
}

function list(v) {
  return Array.isArray(v) ? v : [];
}

/** Run fn(); an exception gives undefined (editor hooks must never break the host's UI). */
export function quietly(fn) {
  try {
    return fn();
  } catch {
    return undefined;
  }
}

function safe(fn, fallback) {
  return (...args) => {
    try {
      return fn(...args);
    } catch {
      return typeof fallback === "function" ? fallback(...args) : fallback;
    }
  };
}

/**
 * A name cut in the middle to at most `max` characters ("glyph_outlin…ers.safetensors"): the start
 * and the end (extension) stay; the whole name is in the line's hover text.
 */
export const middleEllipsis = safe((name, max = MAX_NAME_CHARS) => {
  const text = str(name);
  const chars = Array.from(text);
  const limit = Math.max(3, Math.floor(num(max) ?? MAX_NAME_CHARS));
  if (chars.length <= limit) return text;
  const keep = limit - 1;
  const head = Math.ceil(keep / 2);
  return `${chars.slice(0, head).join("")}\u2026${chars.slice(chars.length - (keep - head)).join("")}`;
}, "");

/** A file name as a line shows it: without ".safetensors", cut in the middle when long. */
export const shortName = safe((name) => middleEllipsis(str(name).replace(/\.safetensors$/i, "")), "");

/** 0.78 -> "78 %", 0.004 -> "< 1 %", null -> null. */
export const formatShare = safe((share) => {
  const s = num(share);
  if (s === null) return null;
  if (s > 0 && s < 0.005) return "< 1 %";
  return `${Math.round(s * 100)} %`;
}, null);

/** Seconds for humans: "4 ms", "0.12 s", "12.3 s", "2 min 5 s". */
export const formatSeconds = safe((seconds) => {
  const s = num(seconds);
  if (s === null || s < 0) return null;
  if (s < 0.01) return `${Math.round(s * 1000)} ms`;
  if (s < 10) return `${s.toFixed(2)} s`;
  if (s < 120) return `${s.toFixed(1)} s`;
  const m = Math.floor(s / 60);
  return `${m} min ${Math.round(s - m * 60)} s`;
}, null);

/** Bytes for humans: "512 B", "1.5 MiB". */
export const formatBytes = safe((bytes) => {
  const b = num(bytes);
  if (b === null || b < 0) return null;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = b;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return i === 0 ? `${Math.round(v)} B` : `${v < 10 ? v.toFixed(1) : Math.round(v)} ${units[i]}`;
}, null);

/**
 * One adapter's coverage (CoverageReport.to_dict):
 * partial coverage -> "warn", nothing matched -> "error".
 * `name` is used when the coverage does not name its adapter.
 */
export const formatCoverage = safe(
  (coverage, name) => {
    const c = isObj(coverage) ? coverage : {};
    const adapter = str(c.adapter) || str(name) || "adapter";
    const matched = num(c.matched);
    const fileLayers = num(c.file_layers);
    const modelLinears = num(c.model_linears);
    const examples = list(c.unmatched_examples).map((e) => str(e)).filter(Boolean);
    let unmatched = num(c.unmatched);
    if (unmatched === null && examples.length) unmatched = examples.length;
    const format = str(c.format);

    const short = shortName(adapter);
    if (matched === null) {
      return {
        text: `coverage not reported · ${short}`,
        level: "warn",
        title: `${adapter}: this report does not say how many of the adapter's layers were matched.`,
      };
    }

    const ratio = `${matched}/${fileLayers === null ? "?" : fileLayers}`;
    const titleLines = [
      `${adapter}${format ? ` (${format} format)` : ""}`,
      `${matched} model layers matched from ${fileLayers === null ? "?" : fileLayers} adapter layers in the file`
        + (modelLinears === null ? "" : `; the model has ${modelLinears} linear layers`),
    ];
    const keysTotal = num(c.keys_total);
    const keysApplied = num(c.keys_applied);
    if (keysTotal) titleLines.push(`${keysApplied === null ? "?" : keysApplied}/${keysTotal} keys of the file applied`);
    const kinds = isObj(c.kinds) ? Object.entries(c.kinds).filter(([, n]) => num(n)) : [];
    if (kinds.length && kinds.some(([k]) => k !== "lora")) {
      titleLines.push(`targets by type: ${kinds.map(([k, n]) => `${n} ${k}`).join(", ")}`);
    }
    if (unmatched) {
      const what = keysTotal && keysApplied !== null
        ? `${keysTotal - keysApplied} keys (${unmatched} layers or keys)` : `${unmatched} adapter layers or keys`;
      titleLines.push(`${what} not loaded${examples.length ? ", e.g.:" : "."}`);
      for (const e of examples) titleLines.push(`  • ${e}`);
      if (unmatched > examples.length && examples.length) {
        titleLines.push(`  … and ${unmatched - examples.length} more`);
      }
    }

    const teLayers = num(c.text_encoder_layers);
    const teTensors = num(c.text_encoder_tensors);
    const clip = str(c.clip);  // Load LoRA Adapter (model + CLIP): what went onto the CLIP
    const teApplied = num(c.text_encoder_applied_layers);
    const teText = clip
      ? ` · ${teApplied === null ? "?" : teApplied} text-encoder layers on the CLIP`
        + (teLayers ? `, ${teLayers} not applied` : "")
      : teLayers ? ` · ${teLayers} text-encoder layers not applied` : "";
    if (clip) {
      titleLines.push(clip);
    } else if (teLayers) {
      titleLines.push(`${teLayers} text-encoder layers (${teTensors === null ? "?" : teTensors} tensors) not applied: `
        + "this node patches the model only");
    }

    if (matched === 0 && fileLayers === 0 && clip) {  // a text-encoder-only file: the CLIP part is all there is
      return { text: `text encoder only · ${short}${teText}`, level: teLayers ? "warn" : "ok",
        title: titleLines.join("\n") };
    }
    if (matched === 0) {
      return {
        text: `0/${fileLayers === null ? "?" : fileLayers} layers matched — no effect · ${short}`,
        level: "error",
        title: titleLines.join("\n"),
      };
    }
    if (unmatched || (fileLayers !== null && matched < fileLayers)) {
      const missing = unmatched || fileLayers - matched;
      return {
        text: `${ratio} layers, ${missing} not loaded · ${short}${teText}`,
        level: "warn",
        title: titleLines.join("\n"),
      };
    }
    return {
      text: `${ratio} layers · ${short}${format ? ` (${format})` : ""}${teText}`,
      level: clip && teLayers ? "warn" : "ok",  // skipped text-encoder layers (model + CLIP, skip and report)
      title: titleLines.join("\n"),
    };
  },
  () => ({ text: "coverage unreadable · adapter", level: "warn", title: "" }),
);

/** The merge decision (MergeDecision.to_dict) or null when no adapter was applied. */
export const formatDecision = safe(
  (decision) => {
    if (!isObj(decision)) {
      return {
        text: "no adapter applied",
        level: "info",
        title: "The model carried no adapter layers to apply, so the weights were not touched.",
      };
    }
    const requested = str(decision.requested);
    const chosen = str(decision.chosen);
    const share = formatShare(decision.share_lost);
    const threshold = formatShare(decision.threshold);
    const reason = str(decision.reason);
    const layers = num(decision.layers);

    let text;
    if (chosen === "dynamic") {
      if (requested === "dynamic") text = "dynamic (requested)";
      else if (share !== null) text = `dynamic — a merge would lose ${share}`;
      else text = "dynamic — layers cannot take a merge";
    } else if (chosen === "merge") {
      if (requested === "merge") text = "merged (requested)";
      else if (share !== null) text = `merged (${share} lost)`;
      else text = "merged";
    } else if (chosen === "off") {
      text = reason || "off (strength 0)";
    } else {
      text = chosen ? `applied: ${chosen}` : "applied";
    }

    const title = [
      reason,
      requested ? `merge mode requested: ${requested}` : "",
      share !== null ? `a merge rounds away ${share} of the adapters' update` : "",
      requested === "auto" && threshold !== null ? `auto keeps adapters dynamic above ${threshold}` : "",
      layers !== null ? `${layers} adapted layers` : "",
      decision.cached === true ? "measurement reused from the cache" : "",
      num(decision.shared_cache) ? `decision from the shared cache for ${decision.shared_cache} adapter(s)` : "",
      ...(Array.isArray(decision.cache_notes) ? decision.cache_notes.filter((n) => typeof n === "string") : []),
    ].filter(Boolean).join("\n");
    // a shared cache entry that could not be used or written: measured here, said on the badge
    const noted = Array.isArray(decision.cache_notes) && decision.cache_notes.length > 0;
    return { text: noted ? `${text} · shared cache entry ignored` : text, level: noted ? "warn" : "ok", title };
  },
  () => ({ text: "merge decision unreadable", level: "warn", title: "" }),
);

function routesText(routes) {
  if (!isObj(routes)) return "";
  const parts = Object.entries(routes)
    .filter(([, v]) => num(v) !== null)
    .map(([k, v]) => `${k} ${v}`);
  return parts.length ? ` (calls: ${parts.join(", ")})` : "";
}

/** "ran: triton 40, cublaslt 8": the backend each fused call ran ('route:backend' -> calls). */
function ranText(ran) {
  if (!isObj(ran)) return "";
  const total = new Map();
  for (const [k, v] of Object.entries(ran)) {
    if (num(v) === null) continue;
    const b = k.includes(":") ? k.slice(k.lastIndexOf(":") + 1) : k;
    total.set(b, (total.get(b) ?? 0) + num(v));
  }
  const parts = [...total].sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0])).map(([b, n]) => `${b} ${n}`);
  return parts.length ? `; ran: ${parts.join(", ")}` : "";
}

/**
 * The fused-kernel sites: {mounted, sites, skipped, skip_reasons} from the sampler,
 * or the raw list of site dicts older reports carried. null when absent.
 */
export const formatFusions = safe((fusions) => {
  let mounted;
  let sites;
  let skipped;
  let reasons;
  if (Array.isArray(fusions)) {
    sites = fusions.filter((f) => isObj(f) && list(f.fusions).length);
    const rest = fusions.filter((f) => isObj(f) && !list(f.fusions).length);
    mounted = sites.length;
    skipped = rest.length;
    reasons = [...new Set(rest.map((f) => str(f.skipped)).filter(Boolean))];
  } else if (isObj(fusions)) {
    sites = list(fusions.sites).filter(isObj);
    mounted = num(fusions.mounted) ?? sites.length;
    skipped = num(fusions.skipped) ?? 0;
    reasons = list(fusions.skip_reasons).map((r) => str(r)).filter(Boolean);
  } else {
    return null;
  }

  let text;
  let level;
  if (mounted > 0) {
    text = `fused kernels on ${mounted} site${mounted === 1 ? "" : "s"}`;
    level = "ok";
  } else {
    text = "no fused kernels";
    level = "info";
  }
  if (skipped > 0) text += `, ${skipped} skipped`;

  const title = [];
  for (const s of sites.slice(0, MAX_TITLE_SITES)) {
    const names = list(s.fusions).map((f) => str(f)).filter(Boolean).join(", ");
    title.push(`${str(s.site, "?")}: ${names || "-"}${routesText(s.routes)}${ranText(s.ran)}`);
  }
  if (sites.length > MAX_TITLE_SITES) title.push(`… and ${sites.length - MAX_TITLE_SITES} more sites`);
  if (skipped > 0) {
    title.push(`${skipped} site${skipped === 1 ? "" : "s"} skipped${reasons.length ? ":" : ""}`);
    for (const r of reasons) title.push(`  • ${r}`);
  }
  if (!title.length) title.push("No fusion site was mounted for this tier and model.");
  return { text, level, title: title.join("\n") };
}, null);

/**
 * torch.compile during the sampling: graphs it built, and functions it gave up on (its recompile
 * limit was hit: they run uncompiled from then on). null when the report has no `compile` entry.
 */
export const formatCompile = safe((compile) => {
  if (!isObj(compile)) return null;
  const graphs = num(compile.graphs_compiled) ?? 0;
  const fallbacks = list(compile.fallbacks).filter(isObj);
  if (fallbacks.length) {
    const limit = str(fallbacks[0].limit, "recompile_limit");
    return {
      text: `⚠ torch.compile gave up on ${fallbacks.length} function${fallbacks.length === 1 ? "" : "s"} (${limit})`,
      level: "warn",
      title: [str(compile.message) || `torch.compile hit its ${limit}; these run uncompiled from now on:`,
        ...fallbacks.map((f) => `  • ${str(f.function, "?")}`)].join("\n"),
    };
  }
  if (graphs > 0) {
    return { text: `torch.compile built ${graphs} graph${graphs === 1 ? "" : "s"}`, level: "info",
      title: "Graphs torch.compile compiled during this sampling (a re-sample at another strength builds none)." };
  }
  return null;
}, null);

/**
 * The first model call's check that every adapted layer ran: layers the host computes from their
 * weight without calling them (their adapters then ride the host's cast-time patch), and layers
 * that did not run. null when the report has no `ran_check` entry (every adapted layer ran).
 */
export const formatRanCheck = safe((findings) => {
  const fs = list(findings).filter(isObj);
  if (!fs.length) return null;
  const groups = new Map();
  for (const f of fs) {
    const h = str(f.handled, "?");
    if (!groups.has(h)) groups.set(h, []);
    groups.get(h).push(f);
  }
  const parts = [];
  const title = [];
  let level = "info";
  for (const [handled, g] of groups) {
    if (handled === "not checked") {
      parts.push("layers ran: not checked");
    } else {
      parts.push(`${g.length} layer${g.length === 1 ? "" : "s"} ${handled}`);
      if (handled === "did not run") level = "warn";
    }
    title.push(`${handled}: ${str(g[0].why)}`);
    for (const f of g.slice(0, 8)) if (str(f.layer) !== "*") title.push(`  • ${str(f.layer)}`);
    if (g.length > 8) title.push(`  … and ${g.length - 8} more`);
  }
  return { text: (level === "warn" ? "⚠ " : "") + parts.join(" · "), level, title: title.join("\n") };
}, null);

/**
 * The adapted layers that carry a ComfyUI patch beside ours (`host_patched`: counted, the first few
 * named); null when none.
 */
export const formatHostPatched = safe((hp) => {
  if (!isObj(hp)) return null;
  const n = num(hp.layers);
  if (!n) return null;
  const examples = list(hp.examples).map((x) => str(x)).filter(Boolean);
  const title = [str(hp.why), ...examples.map((x) => `  • ${x}`), n > examples.length ? `  … and ${n - examples.length} more` : ""]
    .filter(Boolean).join("\n");
  return { text: `${n} layer${n === 1 ? "" : "s"} with a ComfyUI patch beside ours (kept dynamic)`, level: "info", title };
}, null);

/**
 * What happened per layer (`layers`), for the groups that took no merge for a reason of the host's
 * ('streamed (dynamic VRAM): dynamic', 're-staged at every load (dynamic VRAM): dynamic', ...): one badge,
 * every such group counted, the layers and the reasons in the hover text; null when there is none. Layers
 * kept dynamic because ComfyUI patches them itself are the host_patched badge's.
 */
const HOST_PATCHED_LABEL = "ComfyUI patch beside ours: ";   // the host_patched badge shows these already

export const formatLayers = safe((groups) => {
  const gs = list(groups).filter((g) => isObj(g) && str(g.what).includes(": ") && num(g.layers)
    && !str(g.what).startsWith(HOST_PATCHED_LABEL));
  if (!gs.length) return null;
  const text = gs.map((g) => `${num(g.layers)} layer${num(g.layers) === 1 ? "" : "s"} ${str(g.what)}`).join(" · ");
  const title = [];
  for (const g of gs) {
    title.push(`${str(g.what)}${g.why ? ` — ${str(g.why)}` : ""}`);
    const names = list(g.names).map((x) => str(x)).filter(Boolean);
    for (const n of names.slice(0, 8)) title.push(`  • ${n}`);
    if (num(g.layers) > Math.min(8, names.length)) title.push(`  … and ${num(g.layers) - Math.min(8, names.length)} more`);
  }
  return { text, level: "info", title: title.join("\n") };
}, null);

/** Patch time and seconds per step; null when the report has no timings. */
export const formatTimings = safe((report) => {
  const r = isObj(report) ? report : {};
  const patch = formatSeconds(r.patch_seconds);
  const perStep = num(r.seconds_per_step);
  const sample = formatSeconds(r.sample_seconds);
  const total = formatSeconds(r.total_seconds);
  const restore = formatBytes(r.restore_bytes);
  const parts = [];
  if (patch !== null) parts.push(r.adapters_kept === true ? `kept (${patch})` : `patch ${patch}`);
  if (perStep !== null) parts.push(`${perStep < 10 ? perStep.toFixed(2) : perStep.toFixed(1)} s/step`);
  if (!parts.length && sample === null && total === null) return null;
  if (!parts.length) parts.push(`sampling ${sample ?? total}`);
  const title = [
    patch !== null ? (r.adapters_kept === true ? `adapters kept on from the last sampling (resumed in ${patch})`
      : `applying the adapters: ${patch}`) : "",
    sample !== null ? `sampling: ${sample}${perStep !== null ? ` (${perStep} s per step)` : ""}` : "",
    total !== null ? `total in the LoRA Sampler: ${total}` : "",
    restore !== null ? `kept to restore the weights: ${restore}` : "",
  ].filter(Boolean).join("\n");
  return { text: parts.join(" · "), level: "info", title };
}, null);

function strengthText(v) {
  const s = num(v);
  if (s === null) return "";
  return ` ×${Number.isInteger(s) ? s.toFixed(1) : String(Math.round(s * 1000) / 1000)}`;
}

function coverageWarning(items) {
  const errors = items.filter((i) => i.level === "error").length;
  const warns = items.filter((i) => i.level === "warn").length;
  if (!errors && !warns) return null;
  const parts = [];
  if (errors) parts.push(`${errors} adapter${errors === 1 ? "" : "s"} matched no layer`);
  if (warns) parts.push(`${warns} adapter${warns === 1 ? "" : "s"} only partly loaded`);
  return {
    key: "coverage-warning",
    text: `⚠ ${parts.join(", ")} — hover for details`,
    level: errors ? "error" : "warn",
    title: items.filter((i) => i.level !== "ok").map((i) => i.title).join("\n\n"),
  };
}

/** Badges for the Load LoRA Adapter node's `lora_coverage` list. */
export const formatCoverageList = safe((coverageList) => {
  const entries = Array.isArray(coverageList) ? coverageList : isObj(coverageList) ? [coverageList] : [];
  const items = entries.map((c, i) => ({ key: `coverage:${i}`, ...formatCoverage(c) }));
  const warning = coverageWarning(items);
  return warning ? [...items, warning] : items;
}, []);

/** An adapter's block filter for the badge's title: the text, layers per factor, layers left out. */
function blocksText(b) {
  if (!isObj(b)) return "";
  const groups = list(b.strengths).filter(isObj).map((g) =>
    `${Number(g.layers)} layers x${Number(g.factor)}${g.where ? ` (${str(g.where)})` : ""}`);
  const out = Number(b.excluded) > 0 ? `; ${Number(b.excluded)} left out${b.excluded_where ? ` (${str(b.excluded_where)})` : ""}` : "";
  return `blocks '${str(b.text)}': ${groups.join(", ")}${out}`;
}

/** The ordered badge list for the LoRA Sampler node. [] for null/undefined. */
export const formatReport = safe(
  (report) => {
    if (report === null || report === undefined) return [];
    if (!isObj(report)) {
      return [{ key: "invalid", text: "LoRA runtime report unreadable", level: "warn", title: "" }];
    }
    const out = [{ key: "decision", ...formatDecision(report.decision) }];

    const adapterItems = [];
    list(report.adapters).forEach((a, i) => {
      const ad = isObj(a) ? a : {};
      const name = str(ad.name) || str(isObj(ad.coverage) ? ad.coverage.adapter : "") || `adapter ${i + 1}`;
      const covIn = isObj(ad.coverage) && Object.keys(ad.coverage).length ? ad.coverage : null;
      const cov = formatCoverage(covIn, name);
      // layer count, this adapter's decision, then the file (cut in the middle) and its strength
      const label = `${shortName(name)}${strengthText(ad.strength)}`;
      const c = covIn ?? {};
      const matched = num(c.matched);
      const fileLayers = num(c.file_layers);
      const missing = num(c.unmatched) || (matched !== null && fileLayers !== null && matched < fileLayers
        ? fileLayers - matched : 0);
      let head;
      if (matched === null) head = "coverage not reported";
      else if (matched === 0) head = `0/${fileLayers ?? "?"} layers matched — no effect`;
      else head = `${matched}/${fileLayers ?? "?"} layers${missing ? `, ${missing} not loaded` : ""}`;
      const chosen = isObj(ad.decision) ? str(ad.decision.chosen) : "";
      const word = { merge: "merged", dynamic: "dynamic" }[chosen] || "";
      const format = str(c.format);
      const teLayers = num(c.text_encoder_layers);
      let text = `${head}${word ? ` · ${word}` : ""} · ${label}${format && !missing && matched ? ` (${format})` : ""}`
        + (teLayers ? ` · ${teLayers} text-encoder layers not applied` : "");
      let level = cov.level;
      if (ad.enabled === false) {
        text = `disabled · ${label}`;
        level = "info";
      } else if (chosen === "off") {
        text = `${str(ad.decision.reason) || "off (strength 0)"} · ${label}`;
        level = "info";
      }
      const path = str(ad.path);
      const title = [`${name}${strengthText(ad.strength)}`, cov.title, path ? `file: ${path}` : "",
        ad.format ? `format: ${str(ad.format)}` : "",
        ad.schedule ? `strength schedule: ${str(ad.schedule)}` : "",
        ad.branch ? `branch: ${str(ad.branch)}` : "",
        ad.schedule_applied ? `applied: ${str(ad.schedule_applied)}` : "",
        blocksText(ad.blocks)]
        .filter(Boolean).join("\n");
      if (ad.schedule || ad.branch) text += ad.branch ? ` · ${str(ad.branch)}` : " · scheduled";
      if (isObj(ad.blocks)) text += ` · blocks${Number(ad.blocks.excluded) > 0 ? ` (${ad.blocks.excluded} left out)` : ""}`;
      adapterItems.push({ key: `adapter:${i}`, text, level, title });
    });
    out.push(...adapterItems);
    const warning = coverageWarning(adapterItems);
    if (warning) out.push(warning);

    const fusions = formatFusions(report.fusions);
    if (fusions) out.push({ key: "fusions", ...fusions });

    const settings = [
      str(report.tier) ? `tier ${str(report.tier)}` : "",
      str(report.mode_requested) ? `mode ${str(report.mode_requested)}` : "",
      str(report.host) ? `${str(report.host)} host` : "",
    ].filter(Boolean);
    if (settings.length) {
      out.push({
        key: "settings",
        text: settings.join(" · "),
        level: "info",
        title: "Quality tier and merge mode the sampler ran with.",
      });
    }

    const hostPatched = formatHostPatched(report.host_patched);
    if (hostPatched) out.push({ key: "host_patched", ...hostPatched });

    const layers = formatLayers(report.layers);
    if (layers) out.push({ key: "layers", ...layers });

    const ranCheck = formatRanCheck(report.ran_check);
    if (ranCheck) out.push({ key: "ran_check", ...ranCheck });

    const compiled = formatCompile(report.compile);
    if (compiled) out.push({ key: "compile", ...compiled });

    const timings = formatTimings(report);
    if (timings) out.push({ key: "timings", ...timings });
    return out;
  },
  () => [{ key: "invalid", text: "LoRA runtime report unreadable", level: "warn", title: "" }],
);

/** A badge's hover text: its whole line (it may be cut with an ellipsis on the node), then the details. */
export const hoverText = safe((item) => {
  if (!isObj(item)) return "";
  const text = str(item.text);
  const title = str(item.title);
  if (!title || title === text) return text;
  if (!text || title.startsWith(text)) return title;
  return `${text}\n${title}`;
}, "");

const SEVERITY = { error: 0, warn: 1 };

/**
 * The one-line badge shown instead of the lines when there is no room for them under the
 * node: errors and warnings first, then the lines in order, joined; its hover text holds
 * every line whole. null for no badges.
 */
export const collapsedSummary = safe((items) => {
  const all = list(items).filter(isObj);
  if (!all.length) return null;
  const rank = (i) => SEVERITY[i.level] ?? 2;
  const ordered = all.map((item, i) => ({ item, i }))
    .sort((a, b) => rank(a.item) - rank(b.item) || a.i - b.i)
    .map((x) => x.item);
  return {
    key: "summary",
    text: ordered.map((i) => str(i.text)).filter(Boolean).join(" · "),
    level: str(ordered[0].level, "info"),
    title: all.map((i) => str(i.text)).filter(Boolean).join("\n"),
    count: all.length,
  };
}, null);

/** One line for node.properties / logs: the badges' texts joined. */
export const summarize = safe((items) => list(items).map((i) => str(isObj(i) ? i.text : "")).filter(Boolean)
  .join(" | "), "");

/**
 * The report a node received, from an `executed` output
 * ({lora_report: [report]} or {lora_coverage: [coverage, ...]}).
 * Returns {kind: "report" | "coverage", payload} or null.
 */
export const payloadFromOutput = safe((output) => {
  if (!isObj(output)) return null;
  if ("lora_report" in output) {
    const r = output.lora_report;
    const payload = Array.isArray(r) ? r[r.length - 1] : r;
    return payload === undefined ? null : { kind: "report", payload };
  }
  if ("lora_coverage" in output) {
    return { kind: "coverage", payload: output.lora_coverage };
  }
  return null;
}, null);

/** Badges for a payload of either kind. */
export const formatPayload = safe((kind, payload) => (kind === "coverage"
  ? formatCoverageList(payload)
  : formatReport(payload)), []);
