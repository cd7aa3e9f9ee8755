"""bench_rerun.py at --smoke size, the bundled-host part only (no ComfyUI in CI): every arm samples
its model several times in a row (the script checks each arm's latent is the same in every sampling
and differs from the base's), the table parses with a row per arm, our re-runs report their kept
adapters, and the re-run per-call cost line is printed. Times nothing: no timing assertion."""

from testkit.bench_smoke import run_smoke

ARMS = ("base alone", "ours dynamic x1", "ours dynamic x4", "ours merge x1", "ours merge x4", "ours auto x1",
        "ours auto x4")


def test_bench_rerun_smoke_bundled_table_and_rerun_line():
    out = run_smoke("bench_rerun.py", args=("--parts", "bundled"))
    lines = out.strip().splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("| form | host | arm |"))
    cols = [c.strip() for c in lines[head].strip("|").split("|")]
    rows = []
    for ln in lines[head + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(cols), ln
        rows.append(dict(zip(cols, cells)))
    assert [r["arm"].split(" (chose")[0] for r in rows] == list(ARMS)
    for r in rows:
        assert r["host"] == "bundled" and r["same latent"] == "yes", r
        float(r["s/step (CPU)"]), float(r["re-run setup ms"]), float(r["first setup ms"])
        if r["arm"] != "base alone":
            runs, total = r["kept (re-runs)"].split("/")
            assert runs == total and int(total) >= 1, r  # every re-run resumed the kept adapters
            float(r["re-run added ms"])
    rerun = [ln for ln in lines if ln.startswith("re-run per-call cost (merge x1, fp32, bundled): ")]
    assert len(rerun) == 1 and rerun[0].endswith(" ms added"), lines[-12:]
    float(rerun[0].split(": ")[1].split(" ms")[0])
