"""bench_shared_shrink.py at --smoke size: both cases run end to end (their outputs checked
against fp64 and the adapter-off output inside the script), the sibling group serves calls, and
the script ends with its two ratio lines. Times nothing: no timing assertion."""

from testkit.bench_smoke import ROOT, run_smoke


def test_bench_shared_shrink_smoke_prints_its_ratio_lines():
    out = run_smoke("bench_shared_shrink.py", cwd=ROOT / "bench")
    lines = out.strip().splitlines()
    assert "# qkv shared:" in out and "calls served from a sibling's GEMM so far 2" in out
    assert "# qkv unshared:" in out and "sibling groups 0" in out
    assert lines[-2].startswith("added time segmented / per part (sliced): ")
    assert lines[-1].startswith("added time shared / unshared (qkv): ") and float(lines[-1].split(": ")[1]) != 0
