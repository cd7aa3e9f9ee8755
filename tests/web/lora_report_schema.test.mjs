// The report's schema (web/lora_report.schema.json) is defined once: the Python tests
// validate the node's reports against it, these tests validate the formatter's
// fixture and reports the main job wrote, and check a wrong report fails.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { fullReport, tree } from "../testkit/web/harness.mjs";
import { loadSchema, validate } from "../testkit/web/schema.mjs";

const fmt = await import(tree().format);
const schema = loadSchema();
const MAIN_JOB_REPORTS = join(dirname(fileURLToPath(import.meta.url)), "fixtures", "main_job_reports.json");

test("the formatter's full fixture follows the schema", () => {
  assert.deepEqual(validate(fullReport(), schema), []);
});

test("reports the main job wrote follow the schema and format as the decision they carry", () => {
  const rows = JSON.parse(readFileSync(MAIN_JOB_REPORTS, "utf8"));
  assert.ok(rows.length >= 3);
  for (const row of rows) {
    assert.deepEqual(validate(row.report, schema), [], row.run);
    const items = fmt.formatReport(row.report);
    assert.equal(items[0].key, "decision");
    const dec = row.report.decision;
    if (dec && dec.chosen === "dynamic" && dec.requested === "auto") {
      assert.match(items[0].text, /^dynamic — a merge would lose \d+ %$/, row.run);
    }
    if (dec && dec.chosen === "merge" && dec.requested === "auto") assert.match(items[0].text, /^merged \(/, row.run);
  }
});

test("fields other engineers add are allowed (additional properties)", () => {
  const r = fullReport();
  r.schedules = [{ adapter: "a", kind: "linear" }];
  r.adapters[0].scale_source = "per-layer .alpha";
  r.adapters[0].coverage.keys_not_applied = ["x"];
  r.decision.new_field = 1;
  assert.deepEqual(validate(r, schema), []);
});

test("wrong answers fail: missing decision, bad share, bad mode, wrong types", () => {
  const missing = fullReport();
  delete missing.decision;
  assert.ok(validate(missing, schema).some((e) => /missing decision/.test(e)));
  const share = fullReport();
  share.decision.share_lost = 1.7;
  assert.notDeepEqual(validate(share, schema), []);
  const mode = fullReport();
  mode.mode_requested = "sometimes";
  assert.notDeepEqual(validate(mode, schema), []);
  const fus = fullReport();
  fus.fusions.mounted = "2";
  assert.notDeepEqual(validate(fus, schema), []);
  const cov = fullReport();
  delete cov.adapters[1].coverage.matched;
  assert.ok(validate(cov, schema).some((e) => /adapters\[1\]\.coverage: missing matched/.test(e)));
  // a null decision (no adapter) is valid
  const none = fullReport();
  none.decision = null;
  none.adapters = [];
  assert.deepEqual(validate(none, schema), []);
});

test("layers: per-layer groups follow the schema; a group without names or with 0 layers fails", () => {
  const r = fullReport();
  r.layers = [{ what: "streamed (dynamic VRAM): dynamic", layers: 2, names: ["a", "b"], why: "w" }];
  assert.deepEqual(validate(r, schema), []);
  const bad = fullReport();
  bad.layers = [{ what: "dynamic", layers: 0 }];
  const errors = validate(bad, schema);
  assert.ok(errors.some((e) => /missing names/.test(e)) && errors.some((e) => /0 < 1/.test(e)), errors.join("; "));
});
