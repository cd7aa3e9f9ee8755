"""lora_runtime: the engine. Pure torch; importable and testable without ComfyUI.

Public API: load_adapter, match_adapter, AdapterSpec, Intent, plan, plan_intent, applied, LoraInjector,
AdaptedLayer, DecisionCache, runtime_context, Tier, MergeMode and the errors; strength
schedules and branches: parse_schedule, Branch, SamplingSchedules, sampling_schedules,
model_call_context (see `schedule`).
"""
from .files.coverage import CoverageReport
from .files.layer_adapter import LayerAdapter, LoraAdapter
from .files.load import load_adapter
from .files.match import match_adapter
from .apply import ApplyReport, LoraInjector, Plan, plan, plan_intent
from .resident import applied
from .errors import (AdapterFileError, AdapterFormatError, AdapterMatchError, ConfigError, LoraRuntimeError,
                     MergeRefusedError, NonFiniteMergeError, RestoreError)
from .intent import AdapterSpec, Intent
from .decision.cache import DecisionCache
from .decision.policy import MergeDecision, decide, measure_share_lost
from .layer.runtime_context import RuntimeContext, current_context, runtime_context
from .layer.schedule import (Branch, SamplingSchedules, Schedule, model_call_context, parse_branch, parse_schedule,
                       sampling_schedules)
from .settings import (AUTO_MERGE_MAX_ROUNDING_LOSS, MergeMode, RestoreMemory, Tier, parse_merge_mode,
                       parse_restore_memory, parse_tier)
from .layer.wrapper import AdaptedLayer
from .layer.weight_merge import mergeable

__all__ = [name for name in dir() if not name.startswith("_")]
