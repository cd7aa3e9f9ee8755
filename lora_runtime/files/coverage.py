"""`CoverageReport`: how an adapter lined up with a model, and the refusal of one that does not."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import AdapterMatchError
from . import text_encoder_keys
from .key_formats import guess_family
from .param_deltas import ParamDelta
from .unresolved import NO_SUCH_LAYER

@dataclass
class CoverageReport:
    adapter: str
    format: str
    matched: list[str]                  # model targets (module or parameter names)
    unmatched: dict[str, str]           # file stem or key -> reason
    model_linears: int
    file_layers: int
    scale_source: str = ""
    notes: list[str] = field(default_factory=list)
    applied_layers: int = -1            # file stems applied (several stems may share one fused target)
    keys_total: int = 0                 # tensors in the file
    keys_applied: int = 0               # tensors whose update is applied
    kinds: dict[str, int] = field(default_factory=dict)   # update kind -> targets
    unmatched_tensors: int = 0          # tensors of the unmatched layers and keys
    text_encoder_layers: int = 0        # text-encoder layers of the file (a model-only loader leaves them)
    text_encoder_tensors: int = 0

    def __post_init__(self):
        if self.applied_layers < 0:
            self.applied_layers = len(self.matched)

    @property
    def partial(self) -> bool:
        return bool(self.unmatched)

    def examples(self, n: int = 5) -> list[str]:
        return [f"{k} ({v})" for k, v in list(self.unmatched.items())[:n]]

    def summary(self) -> str:
        s = f"{self.adapter}: {self.applied_layers}/{self.file_layers} adapter layers matched ({self.format})"
        if self.keys_total:
            s += f", {self.keys_applied}/{self.keys_total} keys applied"
        if self.unmatched:
            s += f"; {self.unmatched_text()} not loaded, e.g. " + ", ".join(self.examples(3))
        if self.text_encoder_layers:
            s += (f"; {self.text_encoder_layers} text-encoder layers ({self.text_encoder_tensors} tensors) not "
                  "applied: this node patches the model only")
        return s

    def unmatched_text(self) -> str:
        """'N layers or keys (M tensors)': layers and tensors counted separately."""
        return f"{len(self.unmatched)} layers or keys ({self.unmatched_tensors} tensors)"

    def to_dict(self) -> dict:
        return {
            "adapter": self.adapter,
            "format": self.format,
            "matched": self.applied_layers,
            "file_layers": self.file_layers,
            "model_linears": self.model_linears,
            "targets": len(self.matched),
            "keys_applied": self.keys_applied,
            "keys_total": self.keys_total,
            "kinds": dict(self.kinds),
            "unmatched": len(self.unmatched),
            "unmatched_tensors": self.unmatched_tensors,
            "unmatched_examples": self.examples(20),
            "text_encoder_layers": self.text_encoder_layers,
            "text_encoder_tensors": self.text_encoder_tensors,
            "scale_source": self.scale_source,
            "notes": list(self.notes),
        }


def coverage_report(adapter, fmt: str, targets: dict, unmatched: dict[str, str], applied: list[str],
                    model_linears: int) -> CoverageReport:
    """The report of one match: `targets` as `match_adapter` returns them, `unmatched` file stem or
    key -> reason, `applied` the file stems applied."""
    kinds: dict[str, int] = {}
    for t in targets.values():
        k = t.kind if isinstance(t, ParamDelta) else t.update.kind
        kinds[k] = kinds.get(k, 0) + 1
    te_layers, te_tensors = text_encoder_keys.counts(adapter.text_encoder)
    keys_total = sum(len(la.keys) for la in adapter.layers.values()) + len(adapter.ignored_keys) + te_tensors
    unmatched_tensors = sum(len(adapter.layers[k].keys) if k in adapter.layers else 1 for k in unmatched)
    keys_applied = sum(len(adapter.layers[s].keys) for s in applied)
    report = CoverageReport(adapter.name, fmt, sorted(targets), unmatched, model_linears, len(adapter.layers),
                            adapter.scale_source, list(adapter.notes), applied_layers=len(applied),
                            keys_total=keys_total, keys_applied=keys_applied, kinds=kinds,
                            unmatched_tensors=unmatched_tensors, text_encoder_layers=te_layers,
                            text_encoder_tensors=te_tensors)
    if te_layers:
        report.notes.append(text_encoder_keys.note(adapter.text_encoder))
    return report


def refuse(adapter, report: CoverageReport, applied: list[str], hmap, lenient: bool) -> None:
    """Raise `AdapterMatchError` when the file is for another model (none or under half of its
    layers applied) or, unless `lenient`, when any key is left out."""
    looks_like = guess_family(adapter.layers)
    looks = f"; its keys look like an adapter for {looks_like}" if looks_like else ""
    if hmap is not None and looks:
        looks += f" (this model is {hmap.host}'s {hmap.model_class})"
    if not applied:
        found = {k: v for k, v in report.unmatched.items() if k in adapter.layers and v != NO_SUCH_LAYER}
        if found:   # layers of this model that cannot take their update: say why, not "another model"
            raise AdapterMatchError(
                f"{adapter.name}: none of its {len(adapter.layers)} adapter layers can be applied: "
                + ", ".join(f"{k} ({v})" for k, v in list(found.items())[:3])
                + ". Re-export the adapter for this model, or use a loader that supports this update")
        raise AdapterMatchError(
            f"{adapter.name} matches no layer of this model ({len(adapter.layers)} adapter layers, e.g. "
            f"{', '.join(list(adapter.layers)[:3])}){looks}. Pick the adapter made for this model.")
    if len(applied) < 0.5 * len(adapter.layers):
        raise AdapterMatchError(
            f"{adapter.name}: only {len(applied)} of its {len(adapter.layers)} layers match this model "
            f"(e.g. not loaded: {', '.join(report.examples(3))}){looks}. It is most likely an adapter for another "
            "model; pick the one made for this model.")
    if report.unmatched and not lenient:
        raise AdapterMatchError(
            f"{adapter.name}: {report.unmatched_text()} would not be applied: "
            f"{', '.join(report.examples(5))}. Nothing is dropped silently: use the matching adapter, or set "
            "'unmatched keys' to 'skip and report' on the Load LoRA Adapter node to apply the rest.")
