"""``vframe plugins --check NAME``: the conformance kit's quick checks on a registry entry.

Every registry entry called ``NAME`` (of one kind with ``--kind``) gets the
quick form of its kind's check:

==================  =====================================================================
kind                check
==================  =====================================================================
attention_backend   ``check_attention_backend(quick=True)`` in each of float32, bfloat16
                    and float16 that the backend accepts here (on CUDA when a GPU is
                    visible, else on CPU)
scheduler           ``check_scheduler(NAME, quick=True)``
scheduling_policy   ``check_scheduling_policy(NAME, quick=True)``
logits_processor    ``check_logits_processor(NAME)`` with the embedded model's
                    ``PluginContext`` (loads that model: several seconds)
quantizer           ``check_quant_method(NAME, quick=True)`` when it quantizes on load
model               none: parity needs a checkpoint; in your tests use
                    ``vframe.testing.models.assert_matches_transformers``
lifecycle           ``check_lifecycle_hooks(NAME)`` when NAME is a loaded plugin that
                    implements lifecycle hooks (loads the embedded model)
others              none yet
==================  =====================================================================

Each check ends ``PASS``, ``FAIL`` (with the assertion) or ``SKIP`` (it cannot
run here, or no quick check exists). The command exits 0 when at least one
check passed and none failed, else 1: nothing checked is not a pass.
"""

from __future__ import annotations

import inspect
import unittest
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from vframe.plugins import KINDS, get_registry

LIFECYCLE = "lifecycle"  # not a registry kind: NAME is then a plugin name


@dataclass(frozen=True)
class QuickCheck:
    label: str  # "attention_backend 'torch' (float32, cpu)"
    run: Callable[[], None] | None  # None: nothing to run; ``note`` says why
    note: str = ""


@dataclass(frozen=True)
class QuickResult:
    label: str
    status: Literal["PASS", "FAIL", "SKIP"]
    reason: str = ""

    def line(self) -> str:
        reason = " ".join(self.reason.split())  # one line per check
        return f"{self.status}  {self.label}" + (f": {reason}" if reason else "")


def run_quick_checks(name: str, kind: str | None = None) -> list[str]:
    """Run the quick checks on every entry called ``name`` (of ``kind`` only,
    if given) and return the labels of those that ran. The first failure
    propagates (``AssertionError``, or whatever the plugin raised); an unknown
    name raises ``PluginError`` listing what is registered."""
    ran = []
    for check in plan_quick_checks(name, kind):
        if check.run is not None:
            check.run()
            ran.append(check.label)
    return ran


def plan_quick_checks(name: str, kind: str | None = None) -> list[QuickCheck]:
    """The checks ``run_quick_checks`` would run, without running them."""
    checks = []
    for k in _kinds_of(name, kind):
        try:
            checks += _PLANNERS.get(k, _no_check)(k, name)
        except Exception as e:  # noqa: BLE001 - e.g. the entry cannot be imported: its check fails
            checks.append(QuickCheck(f"{k} {name!r}", _raising(e)))
    return checks


def _raising(error: Exception) -> Callable[[], None]:
    def run() -> None:
        raise error

    return run


def run_check(check: QuickCheck) -> QuickResult:
    """Run one check, turning its outcome into PASS, FAIL or SKIP."""
    if check.run is None:
        return QuickResult(check.label, "SKIP", check.note)
    try:
        check.run()
    except unittest.SkipTest as e:
        return QuickResult(check.label, "SKIP", str(e))
    except AssertionError as e:
        return QuickResult(check.label, "FAIL", str(e) or "assertion failed")
    except Exception as e:  # noqa: BLE001 - a plugin raising anything is a failed check
        return QuickResult(check.label, "FAIL", f"{type(e).__name__}: {e}")
    return QuickResult(check.label, "PASS")


def report_quick_checks(name: str, kind: str | None = None, print_line: Callable[[str], None] = print) -> int:
    """What ``vframe plugins --check`` does: one line per check as it finishes;
    returns the exit status (0: something passed and nothing failed)."""
    results = []
    for check in plan_quick_checks(name, kind):
        results.append(run_check(check))
        print_line(results[-1].line())
    passed = any(r.status == "PASS" for r in results)
    return 0 if passed and not any(r.status == "FAIL" for r in results) else 1


def _kinds_of(name: str, kind: str | None) -> list[str]:
    if kind == LIFECYCLE:
        return [LIFECYCLE]
    if kind is not None:
        get_registry(kind).get(name)  # PluginError naming the known entries
        return [kind]
    kinds = [k for k in KINDS if name in get_registry(k)]
    if _has_lifecycle_hooks(name):
        kinds.append(LIFECYCLE)
    if not kinds:
        from vframe.errors import PluginError

        known = ", ".join(f"{k} {n!r}" for k in KINDS for n in get_registry(k).names())
        raise PluginError(
            f"no plugin registers an entry named {name!r}, and no loaded plugin of that name has "
            f"lifecycle hooks; registered: {known}"
        )
    return kinds


def _has_lifecycle_hooks(plugin: str) -> bool:
    from vframe.plugins import loaded_plugins
    from vframe.plugins.hookspecs import LIFECYCLE_HOOKS

    return any(p.name == plugin and set(p.hooks) & set(LIFECYCLE_HOOKS) for p in loaded_plugins())


# --------------------------------------------------------------------------- #
# One planner per kind
# --------------------------------------------------------------------------- #


def _attention_backend(kind: str, name: str) -> list[QuickCheck]:
    import torch

    from vframe.testing.attention import accepted_configurations, check_attention_backend

    cls = get_registry(kind).load(name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    accepted = [d for d in dtypes if accepted_configurations(cls, d, device, quick=True)[0]]

    def check(dtype: torch.dtype) -> QuickCheck:
        label = f"{kind} {name!r} ({str(dtype).removeprefix('torch.')}, {device.type})"
        return QuickCheck(label, lambda: check_attention_backend(name, dtype=dtype, device=device, quick=True))

    # A backend refusing every dtype fails float32's check with its reasons.
    return [check(d) for d in accepted or dtypes[:1]]


def _scheduler(kind: str, name: str) -> list[QuickCheck]:
    def run() -> None:
        from vframe.testing.scheduler import check_scheduler

        check_scheduler(name, quick=True)

    return [QuickCheck(f"{kind} {name!r}", run)]


def _scheduling_policy(kind: str, name: str) -> list[QuickCheck]:
    def run() -> None:
        from vframe.testing.scheduler import check_scheduling_policy

        check_scheduling_policy(name, quick=True)

    return [QuickCheck(f"{kind} {name!r}", run)]


def _logits_processor(kind: str, name: str) -> list[QuickCheck]:
    label = f"{kind} {name!r}"
    cls = get_registry(kind).load(name)
    required = [
        p.name
        for p in inspect.signature(cls).parameters.values()
        if p.default is p.empty and p.name != "context" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        note = (
            f"its constructor needs {', '.join(required)}; test it with "
            f"vframe.testing.logits.check_logits_processor({name!r}, kwargs={{...}})"
        )
        return [QuickCheck(label, None, note)]

    def run() -> None:
        from vframe.testing.logits import check_logits_processor, make_plugin_context

        check_logits_processor(name, context=make_plugin_context())

    return [QuickCheck(label, run)]


def _quantizer(kind: str, name: str) -> list[QuickCheck]:
    label = f"{kind} {name!r} (float32)"
    cls = get_registry(kind).load(name)
    try:
        cls.from_config(None)
    except Exception as e:  # noqa: BLE001 - any refusal means: needs a checkpoint's config
        note = (
            f"it needs a checkpoint's quantization_config (from_config(None) raised {type(e).__name__}: {e}); "
            "test it with vframe.testing.quant.check_quant_method(name, hf_quant_config=..., checkpoint_tensors=...)"
        )
        return [QuickCheck(label, None, note)]

    def run() -> None:
        from vframe.testing.quant import check_quant_method

        check_quant_method(name, quick=True)

    return [QuickCheck(label, run)]


def _lora_kernel(kind: str, name: str) -> list[QuickCheck]:
    def run() -> None:
        from vframe.testing.lora import check_lora_kernel

        check_lora_kernel(get_registry(kind).load(name), quick=True)

    return [QuickCheck(f"{kind} {name!r} (float32)", run)]


def _quant_kernel(kind: str, name: str) -> list[QuickCheck]:
    def run() -> None:
        from vframe.testing.quant_kernel import check_quant_kernel

        check_quant_kernel(name, quick=True)

    return [QuickCheck(f"{kind} {name!r} (float32)", run)]


def _model(kind: str, name: str) -> list[QuickCheck]:
    note = (
        "model parity needs a checkpoint, which a quick check does not have; in your tests call "
        "vframe.testing.models.assert_matches_transformers(<checkpoint dir or .gguf>, prompts)"
    )
    return [QuickCheck(f"{kind} {name!r}", None, note)]


def _lifecycle(kind: str, name: str) -> list[QuickCheck]:
    from vframe.testing.lifecycle import check_lifecycle_hooks

    return [QuickCheck(f"lifecycle hooks of plugin {name!r}", lambda: check_lifecycle_hooks(name))]


def _no_check(kind: str, name: str) -> list[QuickCheck]:
    return [QuickCheck(f"{kind} {name!r}", None, f"no quick check exists for a {get_registry(kind).label} yet")]


_PLANNERS: dict[str, Callable[[str, str], list[QuickCheck]]] = {
    "attention_backend": _attention_backend,
    "scheduler": _scheduler,
    "scheduling_policy": _scheduling_policy,
    "logits_processor": _logits_processor,
    "quantizer": _quantizer,
    "lora_kernel": _lora_kernel,
    "quant_kernel": _quant_kernel,
    "model": _model,
    LIFECYCLE: _lifecycle,
}
