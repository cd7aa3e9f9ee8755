"""Build the folder the device tool carries to the GPU machine for the dynamic-VRAM device run.

    python bench/comfy_dynamic/build_carry.py --comfyui /work/comfy033/ComfyUI        # download, pack, check
    python bench/comfy_dynamic/build_carry.py --comfyui DIR --check-python PY         # + import check (below)
    python bench/comfy_dynamic/build_carry.py --plan                                   # no network, no ComfyUI

What the GPU machine lacks (its image holds torch, numpy, safetensors, pillow and scipy, transformers,
torchvision, torchaudio, einops, psutil, pyyaml, tqdm, packaging... : the device tool's KINDS.md) and
ComfyUI 0.33 imports when ``nodes`` loads: `WHEELS` (comfy-kitchen and comfy-aimdo from ComfyUI's own
requirements.txt, torchsde and trampoline for its samplers) and PyAV, which is replaced by the stand-in
in ``standins/av`` (30 MB of binary never used by the run). The folder (``--out``, default
``bench/.carry/comfy_dynamic``, ignored by git: never committed) holds:

- ``site.tar.xz``: the wheels unpacked (for ``--python-version``, default 3.12, the GPU machine's
  python3) plus the stand-in, without comfy-kitchen's ROCm extension (`DROP`: the GPU is NVIDIA);
  xz packs the CUDA extension to about 22 MB where the wheel's zip holds it in 45 MB;
- ``comfyui.tar.xz``: the ComfyUI checkout's source (`COMFY_PARTS`), checked to be 0.33.0;
- ``manifest.json``: every file's size and sha256, the wheels, what was dropped or stood in for, the
  python it was built for, and the size check: the carried folder plus the working tree that travels
  with it (tracked and untracked files git does not ignore) must stay within `LIMIT` (64 MiB).

``--check-python PY`` (a python with ComfyUI's requirements, e.g. ComfyUI's venv) also unpacks the
carry into a temporary site next to only the GPU machine's base packages taken from PY's site-packages
(`GPU_BASE`: what the image holds that ComfyUI's import needs) and imports what the device run imports
(``comfy.sd``, ``comfy.model_patcher``, ``comfy.ops``, ``nodes``) with nothing else on the path; it needs
the carry built for PY's own python version (``--python-version`` of PY).

``--plan`` writes nothing and reaches no network: the wheels, parts and the size check against the
sizes recorded in `EXPECTED_BYTES` (measured on 2026-12-04) and the working tree as it is; the CI test
of the device run's dry run runs it.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_OUT = REPO / "bench" / ".carry" / "comfy_dynamic"
LIMIT = 64 * 2 ** 20
COMFYUI_VERSION = "0.33.0"
WHEELS = (("comfy-kitchen", "0.2.31"), ("comfy-aimdo", "0.4.13"), ("torchsde", "0.2.6"), ("trampoline", "0.1.2"))
DROP = ("comfy_kitchen/backends/hip/_C",)   # path prefixes left out of the unpacked wheels
STANDINS = ("av",)                           # packages under standins/ carried instead of the real ones
COMFY_PARTS = ("comfy", "comfy_api", "comfy_execution", "comfy_config", "app", "utils", "middleware")
COMFY_SKIP_DIRS = ("__pycache__", "tests")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
# what the GPU image holds that ComfyUI's import needs (the --check-python site takes them from PY)
GPU_BASE = ("torch", "numpy", "safetensors", "pillow", "scipy", "transformers", "tokenizers", "huggingface_hub",
            "regex", "torchvision", "torchaudio", "einops", "psutil", "pyyaml", "tqdm", "packaging", "requests",
            "idna", "filelock", "fsspec", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
            "triton", "urllib3", "certifi", "charset_normalizer", "hf_xet", "httpx", "httpcore", "h11", "anyio",
            "sniffio", "click", "typer", "shellingham", "rich", "markdown_it_py", "mdurl", "pygments",
            "httpx2", "httpcore2", "truststore", "annotated_doc", "sentencepiece")
# measured for --python-version 3.12 on 2026-12-04 (site.tar.xz, comfyui.tar.xz of ComfyUI 0.33.0)
EXPECTED_BYTES = {"site.tar.xz": 21_700_000, "comfyui.tar.xz": 4_200_000, "manifest.json": 4_000}


def log(msg: str) -> None:
    print(f"build_carry: {msg}", flush=True)


def working_tree_bytes() -> int:
    """Bytes of what travels besides the carry: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout.split(b"\0")
    total = 0
    for rel in out:
        if rel:
            p = REPO / rel.decode()
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def size_check(carry_bytes: int) -> dict:
    tree = working_tree_bytes()
    return {"carry_bytes": carry_bytes, "working_tree_bytes": tree, "total_bytes": carry_bytes + tree,
            "limit_bytes": LIMIT, "ok": carry_bytes + tree <= LIMIT}


def download(dest: Path, python_version: str) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [f"{n}=={v}" for n, v in WHEELS]
    log("pip download " + " ".join(f"{n}=={v}" for n, v in WHEELS))
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def unpack_wheels(wheels: list[Path], site: Path) -> list[str]:
    """Unpack every wheel into `site` (its files as pip would place them, no scripts), leaving out
    `DROP`; returns what was left out."""
    dropped = []
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                if info.is_dir():
                    continue
                if any(info.filename.startswith(d) for d in DROP):
                    dropped.append(f"{info.filename} ({info.file_size} bytes)")
                    continue
                target = site / info.filename
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                if info.external_attr >> 16 & 0o111:
                    target.chmod(0o755)
    for name in STANDINS:
        shutil.copytree(HERE / "standins" / name, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dropped


def comfy_version(comfy: Path) -> str:
    text = (comfy / "comfyui_version.py").read_text()
    return text.split('"')[1] if '"' in text else "?"


def comfy_files(comfy: Path) -> list[Path]:
    files = [p for p in comfy.glob("*.py")]
    for part in COMFY_PARTS:
        for root, dirs, names in os.walk(comfy / part):
            dirs[:] = [d for d in dirs if d not in COMFY_SKIP_DIRS]
            files += [Path(root) / n for n in names if not n.endswith(".pyc")]
    return sorted(files)


def xz_tar(out: Path, root: Path, files: list[Path]) -> None:
    with tarfile.open(out, "w:xz", preset=6) as tf:
        for f in files:
            tf.add(f, arcname=str(f.relative_to(root)), recursive=False)


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_imports(out: Path, python: str) -> dict:
    """Import what the device run imports with only the GPU image's base packages (taken from
    `python`'s site-packages) and the carry on the path (see module doc)."""
    code = r'''
import importlib.metadata as md, json, os, re, sys
names = sys.argv[1].split(",")
seen, tops = set(), set()
stack = list(names)
while stack:
    n = stack.pop()
    k = n.lower().replace("_", "-")
    if k in seen:
        continue
    seen.add(k)
    try:
        d = md.distribution(n)
    except md.PackageNotFoundError:
        continue
    for f in d.files or []:
        p = str(f).split("/")[0]
        if p not in ("..", "__pycache__"):
            tops.add(p)
    for r in d.requires or []:
        if "extra ==" not in r:
            stack.append(re.split(r"[ ;<>=!~\[(]", r, 1)[0])
sp = next(p for p in sys.path if p.endswith("site-packages"))
print(json.dumps({"site_packages": sp, "tops": sorted(tops)}))
'''
    r = subprocess.run([python, "-c", code, ",".join(GPU_BASE)], capture_output=True, text=True, check=True)
    info = json.loads(r.stdout.strip().splitlines()[-1])
    tmp = Path(tempfile.mkdtemp(prefix="carry_check_"))
    try:
        base = tmp / "base"
        base.mkdir()
        for t in info["tops"]:
            src = Path(info["site_packages"]) / t
            if src.exists():
                (base / t).symlink_to(src)
        for name in ("site.tar.xz", "comfyui.tar.xz"):
            with tarfile.open(out / name) as tf:
                tf.extractall(tmp / name.split(".")[0], filter="data")
        probe = (f"import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]"
                 f" + [{str(tmp / 'site')!r}, {str(base)!r}]; sys.path.insert(0, {str(tmp / 'comfyui')!r}); "
                 "import comfy.cli_args; comfy.cli_args.args.cpu = True; "
                 "import comfy.model_management, comfy.model_patcher, comfy.ops, comfy.sd, comfy.quant_ops, nodes, "
                 "comfy_aimdo.control, comfy_kitchen, av; "
                 "print('IMPORTED', nodes.UNETLoader.__name__, nodes.LoraLoaderModelOnly.__name__, av.STAND_IN)")
        r = subprocess.run([python, "-S", "-c", probe], cwd=tmp, capture_output=True, text=True)
        ok = r.returncode == 0 and "IMPORTED" in r.stdout
        return {"ok": ok, "python": python, "base_packages": len(info["tops"]),
                **({} if ok else {"error": (r.stdout + r.stderr)[-3000:]})}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plan() -> dict:
    carry = sum(EXPECTED_BYTES.values())
    return {"plan": True, "wheels": [f"{n}=={v}" for n, v in WHEELS], "dropped": list(DROP),
            "standins": list(STANDINS), "comfy_parts": list(COMFY_PARTS), "expected_bytes": EXPECTED_BYTES,
            "size": size_check(carry),
            "standins_present": all((HERE / "standins" / s / "__init__.py").is_file() for s in STANDINS)}


def build(args) -> dict:
    comfy = Path(args.comfyui)
    version = comfy_version(comfy)
    if version != COMFYUI_VERSION:
        raise SystemExit(f"build_carry: {comfy} is ComfyUI {version}, the device run is written for {COMFYUI_VERSION}")
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="carry_build_"))
    try:
        wheels = sorted(Path(args.wheels).glob("*.whl")) if args.wheels else download(tmp / "wheels", args.python_version)
        have = {w.name.split("-")[0].replace("_", "-").lower() for w in wheels}
        missing = [n for n, _ in WHEELS if n not in have]
        if missing:
            raise SystemExit(f"build_carry: no wheel for {missing} in {args.wheels or 'the download'}")
        dropped = unpack_wheels(wheels, tmp / "site")
        site_files = sorted(p for p in (tmp / "site").rglob("*") if p.is_file())
        log(f"packing {len(site_files)} files of {len(wheels)} wheels (xz)")
        xz_tar(out / "site.tar.xz", tmp / "site", site_files)
        files = comfy_files(comfy)
        log(f"packing {len(files)} files of ComfyUI {version}")
        xz_tar(out / "comfyui.tar.xz", comfy, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    py = tuple(int(x) for x in args.python_version.split("."))
    manifest = {"python": list(py), "comfyui": version, "wheels": [w.name for w in wheels], "dropped": dropped,
                "standins": list(STANDINS),
                "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in sorted(out.glob("*.xz"))}}
    carry = sum(f["bytes"] for f in manifest["files"].values()) + EXPECTED_BYTES["manifest.json"]
    manifest["size"] = size_check(carry)
    if args.check_python:
        manifest["import_check"] = check_imports(out, args.check_python)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comfyui", help="ComfyUI 0.33.0 checkout to carry")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--python-version", default="3.12", help="the GPU machine's python (its wheels' tags)")
    p.add_argument("--wheels", help="a folder that already holds the wheels (no download)")
    p.add_argument("--check-python", help="a python with ComfyUI's requirements: check the imports")
    p.add_argument("--plan", action="store_true", help="print the plan and the size check; no network, no writes")
    args = p.parse_args(argv)
    res = plan() if args.plan else build(args) if args.comfyui else p.error("--comfyui or --plan")
    s = res["size"]
    log(f"carry {s['carry_bytes'] / 2**20:.1f} MiB + working tree {s['working_tree_bytes'] / 2**20:.1f} MiB = "
        f"{s['total_bytes'] / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB: {'ok' if s['ok'] else 'OVER'}")
    print(json.dumps(res, indent=1))
    if not s["ok"] or (res.get("import_check") and not res["import_check"]["ok"]):
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()
