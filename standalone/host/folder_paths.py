"""ComfyUI-like model folders for the bundled host.

Mirrors the part of ComfyUI's `folder_paths` module the pack uses
(`get_folder_paths`, `get_filename_list`, `get_full_path`,
`get_full_path_or_raise`, `get_output_directory`, `get_temp_directory`,
`get_save_image_path`), but keeps its state in a `ModelFolders` instance instead
of module globals, so two runs with different folders cannot see each other's
settings.

The module-level functions act on the *active* instance: the one installed by
`activated(folders)` for the current context (the executor does this for a
run), else the process default (`default_folders()`), which reads
`LORA_RUNTIME_MODELS_DIR` / `LORA_RUNTIME_OUTPUT_DIR` when first built.

Names handed to `get_full_path` come from workflows, i.e. from users: they are
relative, use forward slashes, and must stay inside their folder. Anything that
escapes (``..``, absolute paths, symlinks pointing out) is refused with a
ValueError that names the name and the folder.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

ENV_MODELS_DIR = "LORA_RUNTIME_MODELS_DIR"
ENV_OUTPUT_DIR = "LORA_RUNTIME_OUTPUT_DIR"

# The repo root (this file is <repo>/standalone/host/folder_paths.py).
PACK_ROOT = Path(__file__).resolve().parents[2]

# Folder kind -> allowed file extensions (lower case). Only safetensors: the
# bundled host never unpickles a file.
DEFAULT_KINDS: dict[str, tuple[str, ...]] = {
    "diffusion_models": (".safetensors",),
    "loras": (".safetensors",),
    "text_encoders": (".safetensors",),
    "vae": (".safetensors",),
}


class ModelFolders:
    """Model folders, output and temp directories of one host configuration.

    models_dir: root holding one subfolder per kind (default: env
        LORA_RUNTIME_MODELS_DIR, else <repo>/standalone/models).
    output_dir: where SaveImage writes (default: env LORA_RUNTIME_OUTPUT_DIR,
        else <repo>/output).
    extra_paths: more folders per kind, searched after the root's subfolder.
    """

    def __init__(self, models_dir: str | os.PathLike | None = None,
                 output_dir: str | os.PathLike | None = None,
                 temp_dir: str | os.PathLike | None = None,
                 extra_paths: dict[str, list[str | os.PathLike]] | None = None,
                 extensions: dict[str, tuple[str, ...]] | None = None):
        if models_dir is None:
            models_dir = os.environ.get(ENV_MODELS_DIR) or PACK_ROOT / "standalone" / "models"
        if output_dir is None:
            output_dir = os.environ.get(ENV_OUTPUT_DIR) or PACK_ROOT / "output"
        if temp_dir is None:
            temp_dir = Path(tempfile.gettempdir()) / "comfyui_lora_runtime"
        self.models_dir = Path(models_dir).absolute()
        self.output_dir = Path(output_dir).absolute()
        self.temp_dir = Path(temp_dir).absolute()
        self.extensions: dict[str, tuple[str, ...]] = dict(extensions or DEFAULT_KINDS)
        self.folders: dict[str, list[Path]] = {
            kind: [self.models_dir / kind] for kind in self.extensions}
        for kind, paths in (extra_paths or {}).items():
            for p in paths:
                self.add_folder_path(kind, p)

    def __repr__(self) -> str:
        return f"ModelFolders(models_dir={str(self.models_dir)!r}, output_dir={str(self.output_dir)!r})"

    def with_output_directory(self, output_dir: str | os.PathLike) -> "ModelFolders":
        """A copy of this configuration writing to another output directory."""
        new = ModelFolders(self.models_dir, output_dir, self.temp_dir,
                           extensions=self.extensions)
        new.folders = {k: list(v) for k, v in self.folders.items()}
        return new

    # -- model folders -------------------------------------------------------
    def add_folder_path(self, kind: str, path: str | os.PathLike) -> None:
        if kind not in self.extensions:
            self.extensions[kind] = (".safetensors",)
            self.folders[kind] = []
        p = Path(path).absolute()
        if p not in self.folders[kind]:
            self.folders[kind].append(p)

    def _check_kind(self, kind: str) -> None:
        if kind not in self.folders:
            raise KeyError(f"unknown model folder kind {kind!r}; known kinds: {sorted(self.folders)}")

    def get_folder_paths(self, kind: str) -> list[str]:
        self._check_kind(kind)
        return [str(p) for p in self.folders[kind]]

    def get_filename_list(self, kind: str) -> list[str]:
        """Sorted names (relative, forward slashes) of the usable files of `kind`."""
        self._check_kind(kind)
        exts = self.extensions[kind]
        names: set[str] = set()
        for root in self.folders[kind]:
            if not root.is_dir():
                continue
            real_root = root.resolve()
            visited: set[Path] = set()
            for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                real_dir = Path(dirpath).resolve()
                # A symlinked subfolder pointing outside, or a link loop: don't descend.
                if not _is_within(real_dir, real_root) or real_dir in visited:
                    dirnames[:] = []
                    continue
                visited.add(real_dir)
                for f in filenames:
                    if f.startswith(".") or not f.lower().endswith(exts):
                        continue
                    full = Path(dirpath) / f
                    if not _is_within(full.resolve(), real_root):
                        continue  # symlink escaping the folder: get_full_path refuses it too
                    names.add(full.relative_to(root).as_posix())
        return sorted(names)

    def get_full_path(self, kind: str, name: str) -> str | None:
        """Absolute path of `name` in the folders of `kind`, or None if absent.

        Raises ValueError when `name` is not a safe relative name inside the folder.
        """
        self._check_kind(kind)
        rel = _safe_relative_name(kind, name, self.folders[kind])
        for root in self.folders[kind]:
            candidate = root / rel
            real_root = root.resolve()
            if not (candidate.exists() or candidate.is_symlink()):
                continue
            if not _is_within(candidate.resolve(), real_root):
                raise ValueError(
                    f"{kind} name {name!r} resolves outside its folder {str(root)!r} "
                    f"(through a symlink); move the file into the folder instead")
            if candidate.is_file():
                return str(candidate)
        return None

    def get_full_path_or_raise(self, kind: str, name: str) -> str:
        path = self.get_full_path(kind, name)
        if path is None:
            raise FileNotFoundError(
                f"{kind} file {name!r} not found in {self.get_folder_paths(kind)}; "
                f"available: {self.get_filename_list(kind)[:20]}")
        return path

    # -- output --------------------------------------------------------------
    def get_output_directory(self) -> str:
        return str(self.output_dir)

    def get_temp_directory(self) -> str:
        return str(self.temp_dir)


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def _safe_relative_name(kind: str, name: str, roots: list[Path]) -> str:
    where = str(roots[0]) if len(roots) == 1 else [str(r) for r in roots]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{kind} name {name!r} is empty or not a string (folder {where!r})")
    if "\x00" in name:
        raise ValueError(f"{kind} name {name!r} contains a NUL byte (folder {where!r})")
    norm = name.replace("\\", "/")
    if norm.startswith("/") or os.path.isabs(name) or (len(norm) > 1 and norm[1] == ":"):
        raise ValueError(f"{kind} name {name!r} is an absolute path; give a name relative to "
                         f"the folder {where!r}")
    parts = norm.split("/")
    if ".." in parts:
        raise ValueError(f"{kind} name {name!r} escapes the folder {where!r} ('..' is not allowed)")
    return "/".join(p for p in parts if p not in ("", "."))


# -- the active / default instance ------------------------------------------
_default: ModelFolders | None = None
_active: contextvars.ContextVar[ModelFolders | None] = contextvars.ContextVar(
    "comfyui_lora_runtime_active_folders", default=None)


def default_folders() -> ModelFolders:
    """The process-wide default configuration (built from the environment on first use)."""
    global _default
    if _default is None:
        _default = ModelFolders()
    return _default


def active_folders() -> ModelFolders:
    return _active.get() or default_folders()


@contextlib.contextmanager
def activated(folders: ModelFolders | None) -> Iterator[ModelFolders]:
    """Make `folders` the active configuration in this context (None: keep the current one)."""
    if folders is None:
        yield active_folders()
        return
    token = _active.set(folders)
    try:
        yield folders
    finally:
        _active.reset(token)


def get_folder_paths(kind: str) -> list[str]:
    return active_folders().get_folder_paths(kind)


def get_filename_list(kind: str) -> list[str]:
    return active_folders().get_filename_list(kind)


def get_full_path(kind: str, name: str) -> str | None:
    return active_folders().get_full_path(kind, name)


def get_full_path_or_raise(kind: str, name: str) -> str:
    return active_folders().get_full_path_or_raise(kind, name)


def get_output_directory() -> str:
    return active_folders().get_output_directory()


def get_temp_directory() -> str:
    return active_folders().get_temp_directory()


def get_save_image_path(filename_prefix: str, output_dir: str, image_width: int = 0,
                        image_height: int = 0) -> tuple[str, str, int, str, str]:
    """(full_output_folder, filename, counter, subfolder, filename_prefix), as ComfyUI.

    The prefix may hold a subfolder ("runs/img") and %width%/%height%/%year%/...;
    the counter continues after the highest existing `<filename>_NNNNN_` file.
    """
    if "%" in filename_prefix:
        now = time.localtime()
        for key, val in (("%width%", str(image_width)), ("%height%", str(image_height)),
                         ("%year%", str(now.tm_year)), ("%month%", f"{now.tm_mon:02d}"),
                         ("%day%", f"{now.tm_mday:02d}"), ("%hour%", f"{now.tm_hour:02d}"),
                         ("%minute%", f"{now.tm_min:02d}"), ("%second%", f"{now.tm_sec:02d}")):
            filename_prefix = filename_prefix.replace(key, val)
    norm = os.path.normpath(filename_prefix)
    subfolder, filename = os.path.dirname(norm), os.path.basename(norm)
    output_dir = os.path.abspath(output_dir)
    full_output_folder = os.path.abspath(os.path.join(output_dir, subfolder))
    if os.path.commonpath((output_dir, full_output_folder)) != output_dir:
        raise ValueError(f"filename_prefix {filename_prefix!r} would save outside the output "
                         f"folder {output_dir!r}; use a relative prefix without '..'")
    os.makedirs(full_output_folder, exist_ok=True)
    counter = 0
    stem = os.path.normcase(filename) + "_"
    for existing in os.listdir(full_output_folder):
        if not os.path.normcase(existing).startswith(stem):
            continue
        digits = existing[len(stem):].split("_")[0]
        if digits.isdigit():
            counter = max(counter, int(digits))
    return full_output_folder, filename, counter + 1, subfolder, filename_prefix
