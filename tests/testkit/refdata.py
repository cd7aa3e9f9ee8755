"""Where the tests' recorded data lives: tests/data/ (see tests/data/README.md).

`REF` holds the numbers recorded from a real ComfyUI 0.3.64. A missing file is a test
failure naming the file, never a skip: the data ships with the repo.
"""
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
REF = DATA / "comfyui-0.3.64"


def ref_file(name: str) -> Path:
    p = REF / name
    if not p.is_file():
        raise FileNotFoundError(f"test data file {p} is missing; it ships with the repo (tests/data/README.md): "
                                "restore it from git")
    return p
