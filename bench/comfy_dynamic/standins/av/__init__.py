"""A stand-in for PyAV (``av``), carried to the GPU machine instead of the 30 MB binary package.

ComfyUI 0.33 imports PyAV when ``nodes`` loads (its video input and UI types name PyAV classes in
annotations and defaults); the dynamic-VRAM device run never reads or writes a video. Every name and
submodule resolves to a placeholder; calling or instantiating one raises, naming what was used, so a
run that would need the real package fails loudly instead of computing anything.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *a, **k):
        raise RuntimeError(f"{cls.__qualname__}: PyAV is not installed here (a stand-in, see av/__init__.py)")

    def __or__(cls, other):      # used in annotations: av.AudioStream | av.VideoStream
        return cls

    __ror__ = __or__

    def __getitem__(cls, item):
        return cls


def _placeholder(name: str):
    return _Placeholder(name.rpartition(".")[2], (), {"__qualname__": name, "__module__": "av"})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every ``av.<sub>`` import gets a placeholder module."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("av."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
__version__ = "0.0.0+stand-in"
STAND_IN = True


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _placeholder(f"av.{name}")
