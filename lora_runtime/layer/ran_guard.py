"""Reported applied means it ran: the first model call of a sampling checks every adapted layer.

A host can compute with a layer's weight without calling the layer (ComfyUI's int8
feed-forward reads the down projection's quantized weight and runs its own kernel), and a part
of a model can run outside the model call. An adapter that rides on that layer's forward would
then never run while the report says it is applied.

Contract
- `first_call(run, wrappers, model, since)` runs the first model call `run()` and returns (its
  output, findings); with `since` (a `snapshot` taken when the adapters went on) a layer that ran
  before the call, in condition processing, counts as run. A watched layer (one with a dynamic adapter or an output offset) whose forward did
  not run is handled per layer:
  - its host applies cast-time patches (``weight_function``): its adapters move into one
    (`AdaptedLayer.patch_at_cast`: W + delta, as the host's own LoRA) and the call runs again; a
    patch the host then applied is a bypass, handled ("applied at cast time"); a layer whose
    patch was not read did not run at all, and is put back as it was ("did not run");
  - a bypassed layer whose adapters cannot ride a cast-time patch stops the run, naming it;
  - a layer whose host takes no patch and did not run: "did not run".
  Layers found bypassed are remembered (by layer object) and patched before later first calls,
  which report them again when the host reads them at cast time.
- A compiled model call (torch.compile built a graph during it, or did for this model before)
  whose watched layers all went uncounted (traced forwards are not counted) changes nothing,
  and the finding says the check was not made.
- Findings are dicts {"layer", "handled", "why"} for the report; [] when every layer ran.
"""
from __future__ import annotations

import logging
import weakref

from ..compile_watch import graphs_compiled
from ..errors import LoraRuntimeError
from .base_weight import instance_list

log = logging.getLogger(__name__)

CAST = "applied at cast time"
NOT_RUN = "did not run"
NOT_CHECKED = "not checked"

_CAST_WHY = ("the host computes this layer from its weight without calling it; its adapters are added to the "
             "weight when the host casts it (as the host's own LoRA does)")
_BYPASSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # layer -> True
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> True


class _Probe:
    """An identity cast-time patch that counts its calls (does the host read this weight?)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, weight):
        self.calls += 1
        return weight


def snapshot(wrappers) -> dict:
    """Each wrapper's forward and cast counts now: `first_call(since=...)` counts a layer that ran
    from here on (before the first model call too, e.g. in condition processing) as run."""
    return {id(w): (w.calls, w.cast_calls) for w in wrappers}


def _ran(w, before) -> bool:
    calls, casts = before[id(w)]
    return w.calls != calls or (w.cast_patched and w.cast_calls != casts)


def first_call(run, wrappers, model=None, since: dict | None = None):
    watched = [w for w in wrappers if w.watched]
    up_front = [w for w in watched if w.get_base_layer() in _BYPASSED and not w.patch_at_cast()]
    before = snapshot(watched)   # (a bypass found in an earlier sampling is patched up front)
    if since:
        before.update((k, v) for k, v in since.items() if k in before)
    graphs = graphs_compiled()
    out = run()
    missed = [w for w in watched if not _ran(w, before)]
    # layers patched up front that the host read at cast time without calling them: the same bypass
    findings = [{"layer": w.layer_name, "handled": CAST, "why": _CAST_WHY} for w in up_front
                if w.calls == before[id(w)][0] and w.cast_calls != before[id(w)][1]]
    if not missed:
        return out, findings
    compiled = graphs_compiled() != graphs or (model is not None and model in _COMPILED)
    if compiled and len(missed) == len(watched):
        if model is not None:
            _COMPILED[model] = True
        return out, [{"layer": "*", "handled": NOT_CHECKED,
                      "why": "the model call ran as a compiled graph, where the adapted layers' "
                             "forwards are not counted: whether each adapted layer ran was not checked"}]
    patched, probes = [], []
    for w in missed:
        if w.cast_patched:  # patched up front and neither called nor cast: did not run
            findings.append({"layer": w.layer_name, "handled": NOT_RUN, "why": "its weight was not read either"})
            continue
        why = w.patch_at_cast()
        if not why:
            patched.append(w)
        elif isinstance(getattr(w.get_base_layer(), "weight_function", None), list):
            probe = _Probe()
            instance_list(w.get_base_layer(), "weight_function").append(probe)
            probes.append((w, probe, why))
        else:
            findings.append({"layer": w.layer_name, "handled": NOT_RUN, "why": why})
    if patched or probes:
        before = snapshot(patched)
        try:
            out = run()
        finally:
            for w, probe, _ in probes:
                w.get_base_layer().weight_function.remove(probe)
        for w, probe, why in probes:
            if probe.calls:
                raise LoraRuntimeError(
                    f"layer {w.layer_name!r}: the host computes it from its weight without calling the layer, and "
                    f"its adapter cannot be added to that weight: {why}. Nothing was applied; use a model "
                    "without this layer quantized, or an adapter without this layer")
            findings.append({"layer": w.layer_name, "handled": NOT_RUN, "why": "its weight was not read either"})
        for w in patched:
            if w.cast_calls != before[id(w)][1]:
                _BYPASSED[w.get_base_layer()] = True
                findings.append({"layer": w.layer_name, "handled": CAST, "why": _CAST_WHY})
            else:
                w.unpatch_at_cast()
                findings.append({"layer": w.layer_name, "handled": NOT_RUN, "why": "its weight was not read either"})
    for f in findings:
        log.info("LoRA runtime: layer %s %s: %s", f["layer"], f["handled"], f["why"])
    return out, findings
