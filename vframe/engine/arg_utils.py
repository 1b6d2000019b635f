"""``EngineArgs``, vLLM's dataclass of engine keywords (``vllm.engine.arg_utils``).

It has one field per engine setting, named and defaulted as ``LLM(...)``'s
keywords (``docs/configuration.md``), generated from ``EngineConfig`` so that
the two cannot drift, plus ``config_file``::

    from vframe.engine.arg_utils import EngineArgs
    from vframe.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs(max_num_seqs=8))

As with ``LLM(...)``, a field left at its default is not passed on, so
``VFRAME_*`` environment variables and ``config_file`` still set it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from vframe.core.config import _SECTIONS, FLAT_FIELDS, EngineConfig


def _field_specs() -> list[tuple[str, Any, dataclasses.Field]]:
    specs = []
    for name, section in FLAT_FIELDS.items():
        info = _SECTIONS[section].model_fields[name]
        if info.default_factory is not None:
            default = dataclasses.field(default_factory=info.default_factory)
        else:
            default = dataclasses.field(default=info.default)
        specs.append((name, info.annotation, default))
    specs.append(("config_file", str | None, dataclasses.field(default=None)))
    return specs


def _create_engine_config(self: EngineArgs) -> EngineConfig:
    """The validated ``EngineConfig`` (``ConfigError`` names a bad field and value)."""
    kwargs = {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(self)
        if f.name != "config_file" and getattr(self, f.name) != _default(f)
    }
    return EngineConfig.from_sources(config_file=self.config_file, **kwargs)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one ``--flag`` per field, as ``vframe serve`` has them, each ``None`` when
    left out (the default, so ``LLM(**vars(parser.parse_args()))`` works as in vLLM),
    with vLLM's short names (``-tp``, ``-pp``, ``-q``) and value syntax
    (``--max-model-len 32k``, JSON for ``--hf-overrides`` and ``--compilation-config``)."""
    from vframe.entrypoints.cli import add_engine_args

    add_vllm_flag_syntax(parser)
    add_engine_args(parser)
    return parser


def add_vllm_flag_syntax(parser: argparse.ArgumentParser) -> None:
    """The engine flags whose vLLM spelling or value syntax differs from the plain
    ``--name value`` that ``add_engine_args`` gives (it skips flags already added)."""
    from vframe.utils.argparse_utils import human_readable_int

    group = parser.add_argument_group("engine settings with vLLM's syntax")
    for flags, value_type in _VLLM_FLAGS:
        name = flags[0].removeprefix("--").replace("-", "_")
        info = _SECTIONS[FLAT_FIELDS[name]].model_fields[name]
        group.add_argument(
            *flags, dest=name, default=None, help=info.description,
            type=human_readable_int if value_type == "human_int" else value_type,
        )


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None


# vLLM's spelling of these flags; every other field gets add_engine_args' flag.
_VLLM_FLAGS: list[tuple[tuple[str, ...], Any]] = [
    (("--tensor-parallel-size", "-tp"), int),
    (("--pipeline-parallel-size", "-pp"), int),
    (("--quantization", "-q"), str),
    (("--max-model-len",), "human_int"),
    (("--hf-overrides",), _json_value),
    (("--compilation-config",), _json_value),
    (("--mm-processor-kwargs",), _json_value),
]


def _from_cli_args(cls: type[EngineArgs], args: argparse.Namespace) -> EngineArgs:
    from vframe.entrypoints.cli import engine_kwargs

    return cls(config_file=getattr(args, "config_file", None), **engine_kwargs(args))


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs",
    _field_specs(),
    namespace={
        "__doc__": "Engine keywords of ``LLM(...)`` as a dataclass (see the module docstring).",
        "__module__": __name__,
        "create_engine_config": _create_engine_config,
        "add_cli_args": staticmethod(_add_cli_args),
        "from_cli_args": classmethod(_from_cli_args),
    },
)



class AsyncEngineArgs(EngineArgs):  # type: ignore[misc, valid-type]
    """vLLM's ``AsyncEngineArgs``: the same engine keywords, for ``AsyncLLM.from_engine_args``
    (``vframe.v1.engine.async_llm``)."""


__all__ = ["AsyncEngineArgs", "EngineArgs"]
