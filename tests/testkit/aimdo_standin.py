"""A CPU stand-in for comfy-aimdo (the virtual VRAM bar and pinned host buffers of ComfyUI's dynamic
VRAM), so that ComfyUI 0.33's own ``ModelPatcherDynamic`` and ``comfy/ops.py`` vbar cast path run on a
machine without a GPU. Written here from the behaviour ComfyUI's callers rely on (no code of
comfy-aimdo is used); `install()` puts it in place of the real module's native calls.

What it simulates:

- ``ModelVBAR``: a reservation of virtual VRAM. ``alloc(n)`` hands out 512-byte aligned ranges;
  ``fault(range)`` makes a range resident and returns its *signature* (a page generation number:
  equal while the range stayed resident, new after an eviction) or None when the range does not fit
  in the simulated capacity (``set_capacity``): ComfyUI then streams that weight through a cast buffer
  on every call; ``free_memory(n)`` evicts resident ranges, the least recently faulted first, until n
  bytes are free (ComfyUI's ``partially_unload``), filling their bytes with 0xFF so a caller that reads an
  evicted range without re-copying it sees garbage; ``loaded_size()`` the resident bytes. Backing store:
  one CPU uint8 tensor per range (``aimdo_to_tensor``), so "VRAM" is CPU memory here.
- ``HostBuffer``: a growable host buffer (``extend`` / ``truncate`` / ``size`` / ``get_raw_address``)
  backed by one CPU uint8 tensor; ``hostbuf_to_tensor`` returns a view of its first ``size`` bytes.
- pinning: ``torch.cuda.cudart()`` is replaced by an object whose ``cudaHostRegister`` /
  ``cudaHostUnregister`` succeed without doing anything (a CPU tensor stays a CPU tensor).
- ``VRAMBuffer`` (the cast buffer ring) and the analysis / watermark calls: plain CPU buffers and no-ops.

- the device split (`route_vbar_casts`): ComfyUI takes its vbar cast path only for a weight that is
  not on the compute device; on one CPU both are the CPU, so ComfyUI's ``comfy.ops.cast_bias_weight`` is
  wrapped to send every layer that carries a vbar range (``_v``) down that path: ComfyUI's own
  ``cast_modules_with_vbar`` and ``resolve_cast_module_with_vbar`` (fault, pin, copy, its LoRA patch,
  the write-back into the resident copy), then the bookkeeping ComfyUI does after them (prepared
  patches cleared, the prefetch state dropped, the range unpinned by ``uncast_bias_weight``). Layers
  without a range go to ComfyUI's function unchanged.
- the eviction of one model's ranges when another model's faults need the room (`set_capacity` with
  several vbars): a fault that does not fit first evicts the least recently faulted ranges of the
  other vbars, then returns None (streamed) if it still does not fit.

What it does not simulate: a second device (everything is CPU memory; the caller decides which
code path counts as "on the device"), asynchronous copies and streams, the real page size (32 MiB:
here a whole range is one page), memory pressure from other processes, and fault errors.
"""
from __future__ import annotations

import ctypes
import weakref
from collections import OrderedDict

import torch

STATS = {"faults": 0, "resident_hits": 0, "oom": 0, "evicted_bytes": 0, "evictions": 0}


class StandInVBAR:
    """comfy_aimdo.model_vbar.ModelVBAR on CPU memory (see module doc)."""

    capacity = None   # bytes that may be resident at once (None: no limit); set by `set_capacity`
    instances: "weakref.WeakSet" = weakref.WeakSet()   # every live vbar (a model's, per device)

    def __init__(self, size, device):
        self.device = device
        self.max_size = int(size)
        self.offset = 0
        self.base_addr = 1 << 20   # an address only in name: ranges are keys into `_backing`
        self._backing: dict[int, torch.Tensor] = {}
        self._resident: "OrderedDict[int, int]" = OrderedDict()   # addr -> size, in fault order
        self._generation: dict[int, int] = {}
        self._gen = 0
        StandInVBAR.instances.add(self)

    def prioritize(self, malloc_async_clamp=None):
        pass

    def deprioritize(self):
        pass

    def alloc(self, num_bytes):
        self.offset = (self.offset + 511) & ~511
        if self.offset + num_bytes > self.max_size:
            raise MemoryError("VBAR OOM")
        addr = self.base_addr + self.offset
        self.offset += num_bytes
        return (self, addr, num_bytes)

    def _resident_bytes(self) -> int:
        return sum(self._resident.values())

    def fault(self, addr, size):
        STATS["faults"] += 1
        if addr in self._resident:
            STATS["resident_hits"] += 1
            self._resident.move_to_end(addr)
            return _signature(self._generation[addr])
        cap = StandInVBAR.capacity
        if cap is not None and _all_resident() + size > cap:
            for other in list(StandInVBAR.instances):   # another model's ranges give way first
                if other is not self:
                    other.free_memory(_all_resident() + size - cap)
            if _all_resident() + size > cap:
                STATS["oom"] += 1
                return None
        self._gen += 1
        self._generation[addr] = self._gen
        self._resident[addr] = size
        return _signature(self._gen)

    def unpin(self, addr, size):
        pass

    def loaded_size(self):
        return self._resident_bytes()

    def free_memory(self, size_bytes):
        freed = 0
        while self._resident and freed < size_bytes:
            addr, size = self._resident.popitem(last=False)
            buf = self._backing.get(addr)
            if buf is not None:
                with torch.inference_mode(False):
                    buf.fill_(0xFF)   # the pages are gone: a reader that does not copy again gets garbage
            freed += size
            STATS["evicted_bytes"] += size
            STATS["evictions"] += 1
        return freed

    def backing(self, addr, size) -> torch.Tensor:
        t = self._backing.get(addr)
        if t is None or t.numel() != size:
            with torch.inference_mode(False):   # memory, not a result: writable in and out of inference mode
                t = self._backing[addr] = torch.full((size,), 0xFF, dtype=torch.uint8)
        return t

    def get_nr_pages(self):
        return len(self._generation)

    def get_watermark(self):
        return self._resident_bytes()

    def get_residency(self):
        return [1 if a in self._resident else 0 for a in self._generation]

    def set_watermark_limit(self, size_bytes):
        pass

    def set_watermark(self, size_bytes):
        pass


def _all_resident() -> int:
    return sum(v._resident_bytes() for v in list(StandInVBAR.instances))


def _signature(gen: int):
    return (ctypes.c_uint32 * 1)(gen)


def vbar_fault(alloc):
    vbar, addr, size = alloc
    return vbar.fault(addr, size)


def vbar_unpin(alloc):
    if alloc is not None:
        vbar, addr, size = alloc
        vbar.unpin(addr, size)


class StandInHostBuffer:
    """comfy_aimdo.host_buffer.HostBuffer on one CPU uint8 tensor."""

    def __init__(self, size, prewarm=0, max_grow_size=0, mark_cold=True):
        self.max = max(int(size), int(max_grow_size))
        with torch.inference_mode(False):
            self._data = torch.zeros(self.max, dtype=torch.uint8)
        self.size = 0
        if size:
            self.extend(size)

    def get_raw_address(self):
        return self._data.data_ptr()

    def extend(self, size, reallocate=False, register=True):
        size = int(size)
        if self.size + size > self.max:
            raise RuntimeError("HostBuffer.extend failed")
        self.size += size
        return self._data.data_ptr()

    def register(self, offset, size):
        pass

    def unregister(self, offset):
        pass

    def truncate(self, size, do_unregister=True):
        self.size = int(size)

    def read_file_slice(self, *a, **k):
        raise RuntimeError("stand-in HostBuffer reads no files")


class StandInVRAMBuffer:
    """comfy_aimdo.vram_buffer.VRAMBuffer: a growable CPU buffer."""

    def __init__(self, max_size, device):
        self.max_size, self.device = max_size, device
        self._data = torch.empty(0, dtype=torch.uint8)
        self.base_addr = 0

    def size(self):
        return self._data.numel()

    def get(self, size, offset=0):
        need = int(size) + int(offset)
        if need > self._data.numel():
            with torch.inference_mode(False):
                self._data = torch.empty(need, dtype=torch.uint8)
        return (self, int(offset), int(size))


def aimdo_to_tensor(alloc, device):
    owner, addr, size = alloc
    if isinstance(owner, StandInVBAR):
        return owner.backing(addr, size)
    return owner._data[addr:addr + size]


def hostbuf_to_tensor(hostbuf):
    return hostbuf._data[:hostbuf.size]


class _CudaRT:
    """torch.cuda.cudart(): host registration that succeeds and does nothing on CPU memory."""

    @staticmethod
    def cudaHostRegister(ptr, size, flags):
        return 0

    @staticmethod
    def cudaHostUnregister(ptr):
        return 0


def set_capacity(nbytes: int | None) -> None:
    """How many bytes the simulated VRAM holds resident (None: all of them)."""
    StandInVBAR.capacity = nbytes


def install() -> None:
    """Replace comfy-aimdo's native calls (and torch.cuda.cudart's host registration) by the stand-ins.
    Import this before ComfyUI's modules run any of them; they look the names up at call time."""
    import comfy_aimdo.host_buffer
    import comfy_aimdo.model_vbar
    import comfy_aimdo.torch
    import comfy_aimdo.vram_buffer

    comfy_aimdo.model_vbar.ModelVBAR = StandInVBAR
    comfy_aimdo.model_vbar.vbar_fault = vbar_fault
    comfy_aimdo.model_vbar.vbar_unpin = vbar_unpin
    comfy_aimdo.model_vbar.vbars_analyze = lambda device=None: 0
    comfy_aimdo.model_vbar.vbars_reset_watermark_limits = lambda: None
    comfy_aimdo.host_buffer.HostBuffer = StandInHostBuffer
    comfy_aimdo.vram_buffer.VRAMBuffer = StandInVRAMBuffer
    comfy_aimdo.torch.aimdo_to_tensor = aimdo_to_tensor
    comfy_aimdo.torch.hostbuf_to_tensor = hostbuf_to_tensor
    torch.cuda.cudart = lambda: _CudaRT


def route_vbar_casts(device) -> None:
    """Send every cast of a layer with a vbar range down ComfyUI's vbar path (see module doc: the device
    split). `device` is what ``uncast_bias_weight`` is told the weight was cast to."""
    import comfy.ops

    real = comfy.ops.cast_bias_weight
    if getattr(real, "_standin", False):
        return

    def cast_bias_weight(s, input=None, dtype=None, device_=None, bias_dtype=None, offloadable=False,
                         compute_dtype=None, want_requant=False):
        if not hasattr(s, "_v"):
            return real(s, input, dtype, device_, bias_dtype, offloadable, compute_dtype, want_requant)
        if input is not None:
            dtype = input.dtype if dtype is None else dtype
            bias_dtype = dtype if bias_dtype is None else bias_dtype
            device_ = input.device if device_ is None else device_
        STATS["vbar_casts"] = STATS.get("vbar_casts", 0) + 1
        comfy.ops.cast_modules_with_vbar([s], dtype, device_, bias_dtype, False)
        weight, bias = comfy.ops.resolve_cast_module_with_vbar(s, dtype, device_, bias_dtype, compute_dtype,
                                                               want_requant)
        for key in ("weight", "bias"):
            fn = getattr(s, key + "_lowvram_function", None)
            if fn is not None:
                fn.clear_prepared()
        del s._prefetch
        return (weight, bias, (None, device, None)) if offloadable else (weight, bias)

    cast_bias_weight._standin = True
    comfy.ops.cast_bias_weight = cast_bias_weight


def reset() -> None:
    """Zero the counters."""
    for k in list(STATS):
        STATS[k] = 0
