"""bench_auto_measure.py at --smoke size runs and prints its ratio line. Times nothing."""

from testkit.bench_smoke import run_smoke


def test_bench_auto_measure_smoke_prints_its_ratio():
    out = run_smoke("bench_auto_measure.py")
    last = out.strip().splitlines()[-1]
    assert last.startswith("auto measurement / merge: ") and float(last.split(": ")[1]) > 0
