"""vLLM's ``FlexibleArgumentParser`` (``vllm.utils.argparse_utils``): an
``ArgumentParser`` that reads ``--max_model_len`` as ``--max-model-len``, so vLLM
examples that build their flags with ``EngineArgs.add_cli_args(parser)`` run
unchanged::

    from vframe import LLM, EngineArgs
    from vframe.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = LLM(**vars(parser.parse_args()))  # a flag left out is None: the default
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

# What follows "--" up to "=": the flag's name, where "_" becomes "-".
_FLAG_NAME = re.compile(r"(?<=^--)[^=]*")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` taking both ``_`` and ``-`` in flag names, as vLLM's does."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashed(arg) for arg in args], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    return _FLAG_NAME.sub(lambda m: m.group(0).replace("_", "-"), arg, count=1)


def human_readable_int(value: str) -> int:
    """``"1k"`` → 1000, ``"1K"`` → 1024, ``"25.6k"`` → 25600, ``"512"`` → 512 (vLLM's
    ``--max-model-len`` syntax: lowercase suffixes are decimal, uppercase binary)."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value)
    if match is None:
        return int(value)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"decimals are not allowed with binary suffixes like {suffix}; did you mean {number}{suffix.lower()}?"
        )
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


__all__ = ["FlexibleArgumentParser", "human_readable_int"]
