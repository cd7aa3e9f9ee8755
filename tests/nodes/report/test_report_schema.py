"""The report's schema (web/lora_report.schema.json) is defined once and shared: the
node's reports (bundled host, real runs), the CLI/log text and the web formatter's
tests (tests/web/lora_report_schema.test.mjs) all check against the same file."""
import copy
import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")

from comfyui_lora_runtime import NODE_CLASS_MAPPINGS  # noqa: E402
from comfyui_lora_runtime.standalone.host import folder_paths  # noqa: E402
from comfyui_lora_runtime.standalone.host.core_nodes import CORE_NODE_CLASS_MAPPINGS  # noqa: E402
from comfyui_lora_runtime.standalone.host.executor import execute_prompt  # noqa: E402
from comfyui_lora_runtime.nodes import report as report_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = json.loads(report_mod.SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
FIXTURE = ROOT / "tests" / "web" / "fixtures" / "main_job_reports.json"
CLASSES = {**CORE_NODE_CLASS_MAPPINGS, **NODE_CLASS_MAPPINGS}


def errors(r):
    return [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(r)]


def test_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert report_mod.SCHEMA_PATH == ROOT / "web" / "lora_report.schema.json"


@pytest.fixture(scope="module")
def node_reports(tmp_path_factory):
    """Reports the LoRA Sampler node returns on the embedded workflows (1 step: only the report matters)."""
    out = tmp_path_factory.mktemp("out")
    folders = folder_paths.ModelFolders(output_dir=out)
    reports = {}
    for wf, mode in (("embedded_base", None), ("embedded_style", "auto"), ("embedded_distilled", "dynamic")):
        prompt = json.loads((ROOT / "workflows" / "api" / f"{wf}.api.json").read_text())
        for node in prompt.values():
            if node["class_type"] == "LoraRuntimeSampler":
                node["inputs"]["steps"] = 1
            if node["class_type"] == "EmptyHunyuanLatentVideo":
                node["inputs"]["batch_size"] = 1
            if node["class_type"] == "LoraRuntimeMergeMode" and mode:
                node["inputs"]["mode"] = mode
        sampler = next(k for k, n in prompt.items() if n["class_type"] == "LoraRuntimeSampler")
        res = execute_prompt(prompt, CLASSES, folders=folders)
        reports[wf] = res.ui[sampler]["lora_report"][0]
    return reports


def test_node_reports_follow_the_schema(node_reports):
    for wf, r in node_reports.items():
        assert errors(r) == [], wf
    assert node_reports["embedded_base"]["decision"] is None
    assert node_reports["embedded_style"]["decision"]["chosen"] == "merge"
    assert node_reports["embedded_distilled"]["decision"]["chosen"] == "dynamic"


def test_main_job_fixture_follows_the_schema():
    rows = json.loads(FIXTURE.read_text())
    assert {r["run"] for r in rows} >= {"base", "style_auto", "distilled_auto", "distilled_merge"}
    for row in rows:
        assert errors(row["report"]) == [], row["run"]


def _only_required(value, schema):
    """The smallest report the schema admits: only required fields, recursively."""
    if "$ref" in schema:
        return _only_required(value, SCHEMA["$defs"][schema["$ref"].split("/")[-1]])
    if "oneOf" in schema:
        for s in schema["oneOf"]:
            if not list(jsonschema.Draft202012Validator(dict(SCHEMA, **s)).iter_errors(value)):
                return _only_required(value, s)
    if isinstance(value, dict) and "properties" in schema:
        return {k: _only_required(value[k], schema["properties"].get(k, {})) for k in schema.get("required", [])}
    if isinstance(value, list) and "items" in schema:
        return [_only_required(v, schema["items"]) for v in value]
    return value


def test_the_text_reads_only_what_the_schema_requires(node_reports):
    for wf, r in node_reports.items():
        small = _only_required(r, SCHEMA)
        assert errors(small) == [], wf
        assert len(json.dumps(small)) < len(json.dumps(r))  # really smaller
        assert report_mod.text(small).splitlines()[0] == report_mod.text(r).splitlines()[0]


def test_wrong_reports_fail(node_reports):
    r = node_reports["embedded_distilled"]
    assert errors(r) == []  # the right answer passes
    for mutate in (lambda d: d.pop("decision"), lambda d: d["decision"].update(share_lost=1.5),
                   lambda d: d.update(mode_requested="sometimes"), lambda d: d["fusions"].update(mounted="2"),
                   lambda d: d["adapters"][0]["coverage"].pop("matched")):
        bad = copy.deepcopy(r)
        mutate(bad)
        assert errors(bad), mutate
    extra = copy.deepcopy(r)  # fields other engineers add (scale source, keys not applied, schedules) pass
    extra["schedules"] = []
    extra["adapters"][0]["scale_source"] = "metadata"
    extra["adapters"][0]["coverage"]["keys_not_applied"] = []
    assert errors(extra) == []
