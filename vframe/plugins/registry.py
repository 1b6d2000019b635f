"""Name -> implementation registries, one per kind, filled by plugins.

Entries are lazy: ``"package.module:ClassName"`` strings imported on the first
``load(name)``, so that listing what is available imports no kernels. Each entry
remembers the plugin that registered it (``"builtin"`` for vframe's own).

Duplicate names follow one rule: a name already registered by *another* plugin
is refused unless the new registration passes ``override=True``, in which case
the later one wins. A plugin registering the same name twice just replaces its
own entry. So installing a plugin never silently changes what an existing name
means; it has to say so.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from vframe.errors import PluginError

Kind = Literal[
    "model",
    "attention_backend",
    "scheduler",
    "scheduling_policy",
    "kv_cache_manager",
    "sampler",
    "model_runner",
    "quantizer",
    "logits_processor",
    "structured_output",
    "lora_kernel",
    "tool_parser",
    "executor",
    "quant_kernel",
]

BUILTIN = "builtin"

# kind -> (words used in messages, "module:Class" of the interface loaded classes must subclass)
_KINDS: dict[str, tuple[str, str | None]] = {
    "model": ("model architecture", None),  # an nn.Module duck-typing ModelArchitecture
    "attention_backend": ("attention backend", "vframe.core.interfaces:AttentionBackend"),
    "scheduler": ("scheduler", "vframe.core.interfaces:Scheduler"),
    "scheduling_policy": ("scheduling policy", "vframe.core.interfaces:SchedulingPolicy"),
    "kv_cache_manager": ("KV cache manager", "vframe.core.interfaces:KVCacheManager"),
    "sampler": ("sampler", "vframe.core.interfaces:Sampler"),
    "model_runner": ("model runner", "vframe.core.interfaces:ModelRunner"),
    "quantizer": ("quantization method", "vframe.quant.base:QuantizationConfig"),
    "logits_processor": ("logits processor", "vframe.core.interfaces:LogitsProcessor"),
    "structured_output": (
        "structured-output backend",
        "vframe.core.sample.structured:StructuredOutputBackend",
    ),
    "lora_kernel": ("LoRA kernel", None),  # a function typed against vframe.lora.ops:LoRAKernel
    "tool_parser": ("tool-call parser", "vframe.entrypoints.openai.tool_parsers:ToolParser"),
    "executor": ("executor", "vframe.core.interfaces:Executor"),
    "quant_kernel": ("quantized linear kernel", "vframe.quant.kernels:QuantLinearKernel"),
}
KINDS: tuple[str, ...] = tuple(_KINDS)

T = TypeVar("T")


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    target: str | type  # "module:Class", or a class registered directly
    source: str  # plugin that registered it: "builtin" or an entry-point / plugin name

    @property
    def target_str(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"


class Registry(Generic[T]):
    """The implementations of one kind, by name."""

    def __init__(self, kind: str) -> None:
        if kind not in _KINDS:
            raise PluginError(f"unknown registry kind {kind!r}; known: {', '.join(KINDS)}")
        self.kind = kind
        self.label, self._interface = _KINDS[kind]
        self._entries: dict[str, RegistryEntry] = {}
        self._loaded: dict[str, type[T]] = {}

    def register(
        self, name: str, target: str | type, *, source: str = BUILTIN, override: bool = False
    ) -> None:
        self.check_registration(name, target, source=source, override=override)
        self._entries[name] = RegistryEntry(name, target, source)
        self._loaded.pop(name, None)

    def check_registration(
        self, name: str, target: str | type, *, source: str, override: bool = False
    ) -> None:
        """Raise ``PluginError`` if ``register`` with these arguments would be refused."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"{self.label} name must be a non-empty string, got {name!r}")
        _check_target(self.label, name, target)
        existing = self._entries.get(name)
        if existing is not None and existing.source != source and not override:
            raise PluginError(
                f"plugin {source!r} registers {self.label} {name!r}, already registered by "
                f"plugin {existing.source!r} ({existing.target_str}); choose another name, "
                "or pass override=True to replace it"
            )

    def load(self, name: str) -> type[T]:
        """Import and return the class registered as ``name``."""
        cls = self._loaded.get(name)
        if cls is not None:
            return cls
        entry = self.get(name)
        cls = _import_target(self.label, entry)
        if self._interface is not None:
            interface = _import_path(self._interface)
            if not (isinstance(cls, type) and issubclass(cls, interface)):
                raise PluginError(
                    f"{self.label} {name!r} from plugin {entry.source!r} is {entry.target_str}, "
                    f"which is not a subclass of {self._interface}"
                )
        self._loaded[name] = cls
        return cls

    def get(self, name: str) -> RegistryEntry:
        entry = self._entries.get(name)
        if entry is None:
            from vframe.plugins.manager import skipped_plugin_hint

            known = ", ".join(self.names()) or "(none)"
            hint = skipped_plugin_hint(self.kind, name)
            raise PluginError(
                f"unknown {self.label} {name!r}; known: {known}"
                + (f"; {hint}" if hint else "")
                + " (`vframe plugins` lists installed plugins and why any were skipped)"
            )
        return entry

    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[RegistryEntry]:
        return [self._entries[n] for n in self.names()]

    def clear(self) -> None:
        self._entries.clear()
        self._loaded.clear()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"


def _check_target(label: str, name: str, target: Any) -> None:
    if isinstance(target, type):
        return
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if sep and module and attr:
            return
    raise PluginError(
        f"{label} {name!r}: target must be a 'package.module:ClassName' string or a class, "
        f"got {target!r}"
    )


def _import_path(target: str) -> Any:
    module_name, _, attr_path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        obj = getattr(obj, attr)
    return obj


def _import_target(label: str, entry: RegistryEntry) -> Any:
    if not isinstance(entry.target, str):
        return entry.target
    try:
        return _import_path(entry.target)
    except Exception as e:  # noqa: BLE001 - any failure of third-party code is reported the same way
        raise PluginError(
            f"{label} {entry.name!r} from plugin {entry.source!r}: cannot import "
            f"{entry.target!r}: {type(e).__name__}: {e}"
        ) from e
