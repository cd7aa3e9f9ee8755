// A small JSON Schema checker for the subset web/lora_report.schema.json uses
// (type, enum, required, properties, additionalProperties, items, $ref to #/$defs,
// oneOf, minimum, maximum). No npm dependency. Returns a list of "path: problem" strings.
import { readFileSync } from "node:fs";
import { join } from "node:path";

import { WEB_DIR } from "./harness.mjs";

export const SCHEMA_PATH = join(WEB_DIR, "lora_report.schema.json");

export function loadSchema() {
  return JSON.parse(readFileSync(SCHEMA_PATH, "utf8"));
}

function typeOf(v) {
  if (v === null) return "null";
  if (Array.isArray(v)) return "array";
  if (typeof v === "number") return Number.isInteger(v) ? "integer" : "number";
  return typeof v;
}

function typeOk(v, t) {
  const actual = typeOf(v);
  return actual === t || (t === "number" && actual === "integer");
}

const KNOWN = new Set(["$schema", "$id", "$defs", "$ref", "title", "description", "type", "enum", "required",
  "properties", "additionalProperties", "items", "oneOf", "minimum", "maximum"]);

export function validate(value, schema, root = schema, path = "$") {
  const errors = [];
  for (const k of Object.keys(schema)) {
    if (!KNOWN.has(k)) errors.push(`${path}: schema keyword ${k} is not supported by this checker`);
  }
  if (schema.$ref) {
    const name = schema.$ref.replace(/^#\/\$defs\//, "");
    if (!root.$defs || !root.$defs[name]) return [`${path}: unresolved $ref ${schema.$ref}`];
    return validate(value, root.$defs[name], root, path);
  }
  if (schema.type) {
    const types = Array.isArray(schema.type) ? schema.type : [schema.type];
    if (!types.some((t) => typeOk(value, t))) return [`${path}: ${typeOf(value)} is not ${types.join("|")}`];
  }
  if (schema.enum && !schema.enum.includes(value)) errors.push(`${path}: ${JSON.stringify(value)} not in enum`);
  if (schema.oneOf) {
    const ok = schema.oneOf.filter((s) => validate(value, s, root, path).length === 0).length;
    if (ok !== 1) errors.push(`${path}: matches ${ok} of oneOf, not exactly 1`);
  }
  if (typeof value === "number") {
    if (schema.minimum !== undefined && value < schema.minimum) errors.push(`${path}: ${value} < ${schema.minimum}`);
    if (schema.maximum !== undefined && value > schema.maximum) errors.push(`${path}: ${value} > ${schema.maximum}`);
  }
  if (typeOf(value) === "object") {
    for (const r of schema.required || []) if (!(r in value)) errors.push(`${path}: missing ${r}`);
    const props = schema.properties || {};
    for (const [k, v] of Object.entries(value)) {
      if (props[k]) errors.push(...validate(v, props[k], root, `${path}.${k}`));
      else if (schema.additionalProperties === false) errors.push(`${path}: unexpected ${k}`);
      else if (typeof schema.additionalProperties === "object") {
        errors.push(...validate(v, schema.additionalProperties, root, `${path}.${k}`));
      }
    }
  }
  if (Array.isArray(value) && schema.items) {
    value.forEach((v, i) => errors.push(...validate(v, schema.items, root, `${path}[${i}]`)));
  }
  return errors;
}
