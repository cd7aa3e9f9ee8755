"""bench_switch.py at --smoke size: the script runs end to end (every arm, the bit-exact
check after the rounds) and ends with its ratio line. Times nothing: no timing assertion."""

from testkit.bench_smoke import run_smoke


def test_bench_switch_smoke_prints_its_ratio_line():
    out = run_smoke("bench_switch.py")
    lines = out.strip().splitlines()
    assert "restore bit-exact over every weight after 3 merges: True" in out
    assert lines[-3].startswith("dynamic / merge: ")
    assert lines[-2].startswith("swap (restore memory copy) / re-patch: ")
    assert lines[-1].startswith("swap / re-patch: ") and float(lines[-1].split(": ")[1]) > 0
