"""Queue an API-format workflow on a running ComfyUI, follow it, fetch the images.

    pip install websocket-client
    python workflows/api/queue_api.py workflows/api/embedded_style.api.json \
        --server 127.0.0.1:8188 --set 3.mode=dynamic --out output/api

1. POST /prompt {"prompt": ..., "client_id": ...}  -> prompt_id (HTTP 400 carries node_errors)
2. follow ws://SERVER/ws?clientId=... until "execution_success" (or "execution_error")
3. GET /history/<prompt_id> for the outputs, then GET /view?filename=...&type=output for each image
It prints the LoRA Sampler's runtime report from the history: what the merge mode decided
and why (e.g. "mode dynamic -> dynamic (dynamic mode never touches the weights)", or
"mode auto -> dynamic: a merge would lose 95.0% (...)"), layers kept dynamic, coverage.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path


def post_prompt(server: str, prompt: dict, client_id: str) -> str:
    body = json.dumps({"prompt": prompt, "client_id": client_id}).encode()
    req = urllib.request.Request(f"http://{server}/prompt", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)["prompt_id"]
    except urllib.error.HTTPError as e:
        detail = json.loads(e.read() or b"{}")
        raise SystemExit(f"rejected ({e.code}): {json.dumps(detail.get('node_errors') or detail, indent=1)}")


def wait_for(server: str, client_id: str, prompt_id: str, timeout: float = 600.0) -> None:
    import websocket  # websocket-client

    ws = websocket.create_connection(f"ws://{server}/ws?clientId={client_id}", timeout=timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = ws.recv()
            if not isinstance(msg, str):
                continue  # binary preview frames
            m = json.loads(msg)
            data = m.get("data", {})
            if data.get("prompt_id") != prompt_id:
                continue
            if m["type"] == "progress":
                print(f"\r  node {data.get('node')}: {data['value']}/{data['max']}", end="", file=sys.stderr)
            elif m["type"] == "execution_success":
                print(file=sys.stderr)
                return
            elif m["type"] == "execution_error":
                raise SystemExit(f"node {data.get('node_id')} ({data.get('node_type')}) failed: "
                                 f"{data.get('exception_message')}")
        raise SystemExit(f"timed out after {timeout} s")
    finally:
        ws.close()


def decision_text(rep: dict) -> str:
    """What the merge mode decided, from the report's decision dict
    (requested, chosen, share_lost, reason)."""
    d = rep.get("decision") or {}
    requested = d.get("requested") or rep.get("mode_requested", "?")
    if not d:
        return f"mode {requested} -> no adapter"
    text = f"mode {requested} -> {d.get('chosen', '?')}"
    if d.get("share_lost") is not None:  # measured (auto); dynamic and merge modes measure nothing
        text += f": a merge would lose {d['share_lost']:.1%}"
    if d.get("reason"):
        text += f" ({d['reason']})"
    return text


def report_lines(node_id: str, rep: dict) -> list[str]:
    """The LoRA Sampler's runtime report (an entry of a history output's "lora_report")."""
    d = rep.get("decision") or {}
    lines = [f"node {node_id}: {decision_text(rep)}, tier {rep.get('tier', '?')}"]
    if d.get("kept_dynamic"):
        lines.append(f"  {d['kept_dynamic']} layers kept dynamic: {d.get('kept_dynamic_reason', '')}")
    for a in rep.get("adapters", []):
        c = a.get("coverage") or {}
        ad = a.get("decision") or {}
        lines.append(f"  {a.get('name')} x{a.get('strength')}: {c.get('matched', '?')}/{c.get('file_layers', '?')} "
                     "layers" + (f", {c['unmatched']} layers or keys not loaded" if c.get("unmatched") else "")
                     + (f"; {ad['chosen']}" if ad.get("chosen") else "")
                     + (f" (a merge would lose {ad['share_lost']:.1%})" if ad.get("share_lost") is not None else ""))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workflow")
    ap.add_argument("--server", default="127.0.0.1:8188")
    ap.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE")
    ap.add_argument("--out", default="output/api")
    args = ap.parse_args()
    prompt = json.loads(Path(args.workflow).read_text())
    for item in args.set:
        target, _, raw = item.partition("=")
        node, _, name = target.partition(".")
        try:
            prompt[node]["inputs"][name] = json.loads(raw)
        except json.JSONDecodeError:
            prompt[node]["inputs"][name] = raw
    client_id = uuid.uuid4().hex
    prompt_id = post_prompt(args.server, prompt, client_id)
    print(f"queued {prompt_id}", file=sys.stderr)
    wait_for(args.server, client_id, prompt_id)
    with urllib.request.urlopen(f"http://{args.server}/history/{prompt_id}", timeout=30) as r:
        outputs = json.load(r)[prompt_id]["outputs"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for node_id, o in outputs.items():
        for rep in o.get("lora_report", []):
            print("\n".join(report_lines(node_id, rep)))
        for img in o.get("images", []):
            q = urllib.parse.urlencode({"filename": img["filename"], "subfolder": img["subfolder"],
                                        "type": img["type"]})
            with urllib.request.urlopen(f"http://{args.server}/view?{q}", timeout=30) as r:
                (out / img["filename"]).write_bytes(r.read())
            print(out / img["filename"])


if __name__ == "__main__":
    main()
