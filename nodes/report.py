"""The runtime report a LoRA Sampler run returns: for the node UI, the log and the CLI.

Its shape is defined once, in ``web/lora_report.schema.json`` (``SCHEMA_PATH``): ``build``
returns it, ``text`` reads only the fields it requires, the web formatter shows it, and
the tests of all three validate against that file. Additional properties are allowed.
"""
from __future__ import annotations

from pathlib import Path

from ..lora_runtime import ApplyReport, compile_watch
from ..lora_runtime.apply import unique_name

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "web" / "lora_report.schema.json"


def build(report: ApplyReport | None, *, mode: str, tier: str, host: str, sample_seconds: float,
          steps: int, schedules=None, graphs_compiled: int = 0, clip: dict[str, str] | None = None,
          ran_check: list[dict] | None = None, host_patched: dict | None = None) -> dict:
    """The report of one run. ``clip``: planned adapter name -> what a model + CLIP loader did
    with that file's text-encoder layers (shown instead of "not applied: this node patches the
    model only"). ``host_patched`` (`host_patched_entry`): the adapted layers whose weight the host
    patches itself beside ours, counted, per adapter too."""
    d = report.to_dict() if report is not None else {"decision": None, "coverage": [], "adapters": [],
                                                      "fusions": [], "patch_seconds": 0.0, "restore_bytes": 0}
    coverage = {c["adapter"]: c for c in d["coverage"]}
    per_adapter = {a["name"]: a for a in (d["decision"] or {}).get("adapters", [])}
    adapters = []
    for a in d["adapters"]:
        c = coverage.get(a["name"], {})
        entry = {**a, "coverage": c}
        if a["name"] in per_adapter:  # each adapter's own merge decision (auto decides per adapter)
            entry["decision"] = per_adapter[a["name"]]
        if clip and clip.get(a["name"]):
            entry["clip"] = clip[a["name"]]
        if host_patched and host_patched["per_adapter"].get(a["name"]):
            entry["host_patched"] = host_patched["per_adapter"][a["name"]]
        if schedules is not None and a["name"] in schedules.entries:  # what the model calls really used
            entry["schedule_applied"] = schedules.applied(a["name"])
        adapters.append(entry)
    mounted = [f for f in d["fusions"] if f.get("fusions")]
    skipped = [f for f in d["fusions"] if not f.get("fusions")]
    # graphs torch.compile built during the sampling, and functions it gave up on (they run uncompiled now)
    compiled = compile_watch.report_entry(graphs_compiled)
    return {
        **({"compile": compiled} if compiled else {}),
        **({"ran_check": list(ran_check)} if ran_check else {}),
        **({"host_patched": {k: v for k, v in host_patched.items() if k != "per_adapter"}}
           if host_patched and host_patched["layers"] else {}),
        "host": host,
        "mode_requested": mode,
        "tier": tier,
        "decision": d["decision"],
        "adapters": adapters,
        "fusions": {"mounted": len(mounted), "sites": mounted,
                    "skipped": len(skipped), "skip_reasons": sorted({f.get("skipped", "") for f in skipped})},
        "params": d.get("params", []),
        **({"layers": d["layers"]} if d.get("layers") else {}),
        "patch_seconds": d["patch_seconds"],
        **({"adapters_kept": True} if d.get("kept") else {}),
        "restore_bytes": d["restore_bytes"],
        "restore_memory": d.get("restore_memory", "lean"),
        "sample_seconds": round(sample_seconds, 4),
        "seconds_per_step": round(sample_seconds / max(1, steps), 4),
    }


def host_patched_entry(refusals: dict[str, str], adapted: dict[str, list[str]]) -> dict:
    """The adapted layers that carry a host patch beside ours: ``refusals`` (layer -> why the host
    keeps it from a merge: it patches that weight itself), ``adapted`` (planned adapter name -> its
    layers). Returns {"layers": n, "examples": the first few, "why": ..., "per_adapter": {name: k}}."""
    mine = sorted({layer for layers in adapted.values() for layer in layers if layer in refusals})
    return {"layers": len(mine), "examples": mine[:4], "why": refusals[mine[0]] if mine else "",
            "per_adapter": {name: sum(1 for layer in layers if layer in refusals) for name, layers in adapted.items()}}


def host_patched_line(hp: dict) -> str:
    """One line: how many adapted layers carry a ComfyUI patch beside ours, and which."""
    n, ex = hp["layers"], hp.get("examples") or []
    names = ", ".join(ex) + (f" and {n - len(ex)} more" if n > len(ex) else "")
    return (f"  {n} adapted layer{'s' if n != 1 else ''} carr{'y' if n != 1 else 'ies'} a ComfyUI patch beside ours "
            f"({names}): ComfyUI applies its patch to the weight, ours stays dynamic on top")


def layer_lines(groups: list[dict]) -> list[str]:
    """One line per group of layers that share what happened to them ('12 layers streamed (dynamic
    VRAM): dynamic (a, b, c and 9 more)'), when the layers did not all do the same plain thing."""
    if len(groups) == 1 and ":" not in groups[0]["what"]:
        return []   # every layer merged, or every layer dynamic: the decision line says it
    out = []
    for g in groups:
        names = g.get("names") or []
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"  {g['layers']} layer{'s' if g['layers'] != 1 else ''} {g['what']} ({shown})")
    return out


def clip_lines(adapters) -> dict[str, str]:
    """Planned name -> clip line of intent entries (the planner's names: a repeated name gets #2, #3...)."""
    out, used = {}, set()
    for a in adapters:
        name = unique_name(a.name, used)
        if a.clip:
            out[name] = a.clip
    return out


def text(r: dict) -> str:
    """A few lines for the log and the CLI."""
    dec = r.get("decision") or {}
    share = dec.get("share_lost")
    lines = [
        f"LoRA runtime ({r['host']} host): tier {r['tier']}, mode {r['mode_requested']} -> "
        f"{dec['reason'] if dec.get('chosen') == 'off' else dec.get('chosen', 'no adapter')}"
        + (f" (a merge would lose {share:.1%})" if share is not None else ""),
    ]
    if dec.get("kept_dynamic"):
        lines.append(f"  {dec['kept_dynamic']} layers kept dynamic: {dec['kept_dynamic_reason']}")
    if (r.get("host_patched") or {}).get("layers"):
        lines.append(host_patched_line(r["host_patched"]))
    lines.extend(layer_lines(r.get("layers") or []))
    if dec.get("shared_cache"):
        lines.append(f"  decision from the shared cache for {dec['shared_cache']} adapter(s); "
                     f"{dec.get('measured', 0)} measured here")
    lines.extend(f"  {note}" for note in dec.get("cache_notes") or [])
    for a in r["adapters"]:  # as on the node: the layer count and the decision first, then the file
        c = a.get("coverage") or {}
        ad = a.get("decision") or {}
        lines.append(f"  {c.get('matched', '?')}/{c.get('file_layers', '?')} layers"
                     + (f", {c['unmatched']} layers or keys ({c.get('unmatched_tensors', '?')} tensors) not loaded"
                        if c.get("unmatched") else "")
                     + (f", {ad.get('reason') if ad.get('chosen') == 'off' else ad['chosen']}" if ad.get("chosen")
                        else "")
                     + (f" (a merge would lose {ad['share_lost']:.1%})" if ad.get("share_lost") is not None else "")
                     + f": {a['name']} x{a['strength']}"
                     + (f" ({c['format']})" if c.get("format") else "")
                     + (", " + ", ".join(f"{n} {k}" for k, n in sorted(c["kinds"].items()))
                        if set(c.get("kinds") or {}) - {"lora"} else ""))
        if a.get("clip"):
            lines.append(f"    {a['clip']}")
        elif c.get("text_encoder_layers"):
            lines.append(f"    {c['text_encoder_layers']} text-encoder layers ({c['text_encoder_tensors']} tensors) not "
                         "applied: this node patches the model only")
        if a.get("schedule") or a.get("branch"):
            lines.append("    " + "; ".join(x for x in (a.get("schedule"), a.get("branch") and f"{a['branch']} branch",
                                                       a.get("schedule_applied") and
                                                       f"applied: {a['schedule_applied']}") if x))
        if a.get("blocks"):
            lines.append("    " + blocks_text(a["blocks"]))
    lines.extend(ran_check_lines(r.get("ran_check") or []))
    if r.get("params"):
        worst = max(r["params"], key=lambda p: p["share_lost"])
        lines.append(f"  {len(r['params'])} norm/modulation parameters merged (no forward of their own; "
                     f"largest share rounded away {worst['share_lost']:.1%} on {worst['param']})")
    f = r["fusions"]
    lines.append(f"  fusions mounted on {f['mounted']} sites" + (
        f" ({f['skipped']} skipped: {'; '.join(f['skip_reasons'])})" if f["skipped"] else ""))
    ran = backend_calls(f["sites"])
    if ran:
        lines.append("  fused calls by backend: " + ", ".join(f"{b} {n}" for b, n in ran))
    if r.get("restore_bytes"):
        lines.append(f"  restore record ({r.get('restore_memory', 'lean')}): {r['restore_bytes'] / 2**20:.1f} MiB")
    if (r.get("compile") or {}).get("graphs_compiled"):
        lines.append(f"  torch.compile compiled {r['compile']['graphs_compiled']} graph(s) during this sampling")
    if (r.get("compile") or {}).get("message"):
        lines.append(f"  {r['compile']['message']}")
    kept = " (kept on from the last sampling)" if r.get("adapters_kept") else ""
    lines.append(f"  patch {r['patch_seconds']:.3f} s{kept}, {r['seconds_per_step']:.3f} s/step")
    return "\n".join(lines)


def ran_check_lines(findings: list[dict]) -> list[str]:
    """One line per outcome of the first model call's check that every adapted layer ran."""
    groups: dict[str, list[dict]] = {}
    for f in findings:
        groups.setdefault(f["handled"], []).append(f)
    out = []
    for handled, fs in groups.items():
        names = ", ".join(f["layer"] for f in fs[:4]) + (f" and {len(fs) - 4} more" if len(fs) > 4 else "")
        if handled == "not checked":
            out.append(f"  layers ran: {fs[0]['why']}")
        else:
            out.append(f"  {len(fs)} adapted layer{'s' if len(fs) != 1 else ''} {handled} ({names}): {fs[0]['why']}")
    return out


def backend_calls(sites: list) -> list[tuple[str, int]]:
    """(backend, fused calls) over every site's `ran` ('route:backend' -> calls), most first."""
    total: dict[str, int] = {}
    for s in sites:
        for key, n in (s.get("ran") or {}).items():
            b = key.rpartition(":")[2]
            total[b] = total.get(b, 0) + int(n)
    return sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))


def blocks_text(b: dict) -> str:
    """One line for a block filter: 'blocks '0-9: 0.5': 20 layers x0.5 (blocks 0-9), 40 x1 (...); 6 left out (...)'."""
    groups = ", ".join(f"{g['layers']} layer{'s' if g['layers'] != 1 else ''} x{g['factor']:g}"
                       + (f" ({g['where']})" if g.get("where") else "") for g in b.get("strengths", []))
    out = f"blocks {b.get('text', '')!r}: {groups}"
    if b.get("excluded"):
        out += f"; {b['excluded']} left out" + (f" ({b['excluded_where']})" if b.get("excluded_where") else "")
    return out
