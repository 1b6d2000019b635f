"""Exceptions a user can cause. Each message names the field, the value and the fix."""

from __future__ import annotations


class VFrameError(Exception):
    """Base of every error vframe raises on purpose."""


class ConfigError(VFrameError, ValueError):
    """An invalid engine setting."""


class ModelLoadError(VFrameError):
    """A model file or directory that is missing, corrupt or of an unknown architecture."""


class InvalidRequestError(VFrameError, ValueError):
    """A prompt or sampling parameter the engine cannot serve."""


class PluginError(VFrameError):
    """An unknown registry name or a plugin that cannot be used."""


class LoRAAdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served: unreadable, unsupported or made for another model."""


class ExecutorDeadError(VFrameError):
    """A rank of the model (a tensor-parallel worker) died or fell out of step with
    the others: the engine cannot run another step and must be restarted."""
