"""Runs the worked examples of docs/plugins.md, so that a doc example that stops
working fails CI.

An example is built from the fenced code blocks that carry ``example=NAME`` in
their info string; the blocks of one name, in document order, make one example
and one test id:

- ```` ```python example=NAME file=RELATIVE/PATH.py ````: written to that path in
  a temporary directory of its own. Several blocks build one package
  (``file=vframe_plugin_lottery/__init__.py``, ``file=vframe_plugin_lottery/scheduler.py``).
  The directory, and its ``src/`` when a file lies there (the src layout), go on
  ``sys.path``.
- ```` ```toml example=NAME file=pyproject.toml ````: must parse with ``tomllib``
  and declare ``[project.entry-points.vframe]``. Each entry point is imported and
  registered as a plugin with ``vframe.plugins.register_plugin(obj, name)``,
  exactly what installing the package and loading its entry point does, without
  building or installing anything.
- ```` ```python example=NAME test ````: the test code. Its top-level code runs,
  then every function it defines whose name starts with ``test`` is called
  (with no arguments: there are no fixtures). Tracebacks point at the lines of
  the Markdown file.

An example needs at least one test block. Whatever it raises fails its test id;
afterwards its plugins are unregistered and its modules forgotten. Blocks
without ``example=`` are prose and are not run.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import tomllib
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vframe.plugins import register_plugin, reset_plugins, unregister_plugin

PLUGINS_MD = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"

# One complete worked example per kind of plugin (issue 10).
EXPECTED_EXAMPLES = {
    "attention_backend", "model", "scheduling_policy", "logits_processor", "quantizer", "executor", "quant_kernel",
}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>[^`]*)$")


class DocExampleError(Exception):
    """A block's info string or content breaks the convention above."""


@dataclass
class Block:
    language: str
    code: str
    line: int  # line of the Markdown file where the code starts, 1-based
    file: str | None = None
    is_test: bool = False


@dataclass
class Example:
    name: str
    files: list[Block] = field(default_factory=list)
    tests: list[Block] = field(default_factory=list)


def parse_examples(markdown: str) -> dict[str, Example]:
    """The examples of a Markdown text, by name, in order of first appearance."""
    examples: dict[str, Example] = {}
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = i + 1
        while end < len(lines) and not re.fullmatch(rf"{re.escape(indent)}{fence}`*\s*", lines[end]):
            end += 1
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        _add_block(examples, opening["info"].split(), "\n".join(body) + "\n", line=i + 2)
        i = end + 1
    for example in examples.values():
        if not example.tests:
            raise DocExampleError(f"example {example.name!r} has no ```python example={example.name} test``` block")
    return examples


def _add_block(examples: dict[str, Example], info: list[str], code: str, line: int) -> None:
    options = dict(word.split("=", 1) if "=" in word else (word, "") for word in info[1:])
    if "example" not in options:
        return
    where = f"the block at line {line}"
    language = info[0]
    name = options.pop("example")
    file = options.pop("file", None)
    is_test = options.pop("test", None) is not None
    if options:
        raise DocExampleError(f"{where}: unknown option(s) {', '.join(sorted(options))}; use file=PATH or test")
    if not name or (file is None) == (not is_test):
        raise DocExampleError(f"{where}: needs example=NAME and exactly one of file=PATH or test")
    if language not in ("python", "toml") or (language == "toml" and file != "pyproject.toml"):
        raise DocExampleError(f"{where}: only ```python and ```toml ... file=pyproject.toml blocks can be examples")
    if file is not None and (Path(file).is_absolute() or ".." in Path(file).parts):
        raise DocExampleError(f"{where}: file={file} must be a relative path inside the example")
    example = examples.setdefault(name, Example(name))
    block = Block(language, code, line, file, is_test)
    if is_test:
        example.tests.append(block)
    elif any(b.file == file for b in example.files):
        raise DocExampleError(f"{where}: example {name!r} already has a file={file} block")
    else:
        example.files.append(block)


def entry_points(example: Example) -> dict[str, str]:
    """``plugin name -> "module[:attr]"`` from the example's pyproject.toml block(s)."""
    found: dict[str, str] = {}
    for block in example.files:
        if block.language != "toml":
            continue
        try:
            data = tomllib.loads(block.code)
        except tomllib.TOMLDecodeError as e:
            raise DocExampleError(f"the pyproject.toml block at line {block.line} does not parse: {e}") from None
        group = data.get("project", {}).get("entry-points", {}).get("vframe")
        if not group:
            raise DocExampleError(
                f"the pyproject.toml block at line {block.line} declares no [project.entry-points.vframe]"
            )
        found.update(group)
    return found


def run_example(example: Example, workdir: Path, source: str = "<markdown>") -> None:
    """Write the example's files under ``workdir``, register its entry points as
    plugins and run its test blocks; raises whatever they raise."""
    for block in example.files:
        path = workdir / block.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.code)
    plugins = entry_points(example)
    roots = [workdir] + ([workdir / "src"] if (workdir / "src").is_dir() else [])
    with _importable(roots), _registered(plugins):
        for block in example.tests:
            namespace = {"__name__": f"doc_example_{example.name}"}
            # Leading blank lines keep the Markdown's line numbers in tracebacks.
            exec(compile("\n" * (block.line - 1) + block.code, source, "exec"), namespace)
            for name, obj in list(namespace.items()):
                if not (name.startswith("test") and inspect.isfunction(obj)):
                    continue
                if inspect.signature(obj).parameters:
                    raise DocExampleError(
                        f"{source}: {name}() in example {example.name!r} takes arguments; "
                        "doc example tests get no pytest fixtures"
                    )
                obj()


@contextmanager
def _importable(roots: list[Path]) -> Iterator[None]:
    before = set(sys.modules)
    sys.path[:0] = [str(r) for r in roots]
    importlib.invalidate_caches()
    try:
        yield
    finally:
        for root in roots:
            sys.path.remove(str(root))
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if any(origin.startswith(str(root)) for root in roots):
                del sys.modules[name]


@contextmanager
def _registered(plugins: dict[str, str]) -> Iterator[None]:
    added: list[str] = []
    try:
        for name, target in plugins.items():
            module, _, attr = target.partition(":")
            obj = importlib.import_module(module.strip())
            for part in filter(None, attr.strip().split(".")):
                obj = getattr(obj, part)
            register_plugin(obj, name)
            added.append(name)
        yield
    finally:
        for name in reversed(added):
            unregister_plugin(name)


# --------------------------------------------------------------------------- #
# docs/plugins.md
# --------------------------------------------------------------------------- #


@pytest.fixture(autouse=True)
def fresh_plugins() -> Iterator[None]:
    """Each test starts and ends with no plugin loaded."""
    reset_plugins()
    yield
    reset_plugins()


_DOC_TEXT = PLUGINS_MD.read_text()
DOC_EXAMPLES = parse_examples(_DOC_TEXT)


@pytest.mark.parametrize("name", list(DOC_EXAMPLES))
def test_plugins_md_example(name: str, tmp_path: Path) -> None:
    run_example(DOC_EXAMPLES[name], tmp_path, source=str(PLUGINS_MD))


@pytest.mark.skipif("example=" not in _DOC_TEXT, reason="docs/plugins.md rewrite pending")
def test_docs_have_every_kind_of_example() -> None:
    missing = sorted(EXPECTED_EXAMPLES - set(DOC_EXAMPLES))
    assert not missing, f"docs/plugins.md has no worked example named {', '.join(missing)}"


# --------------------------------------------------------------------------- #
# The harness itself
# --------------------------------------------------------------------------- #

FENCE = "```"

SAMPLE_MD = f"""
# A plugin

Prose blocks are not run:

{FENCE}python
raise AssertionError("not an example")
{FENCE}

{FENCE}toml example=ban file=pyproject.toml
[project]
name = "vframe-doc-ban"
version = "0.1.0"

[project.entry-points.vframe]
doc_ban = "vframe_doc_ban"
{FENCE}

{FENCE}python example=ban file=src/vframe_doc_ban/__init__.py
from vframe.plugins import hookimpl


@hookimpl
def vframe_register_logits_processors(register):
    register("doc_ban_seven", "vframe_doc_ban.processor:BanSeven")
{FENCE}

{FENCE}python example=ban file=src/vframe_doc_ban/processor.py
from vframe.core.interfaces import LogitsProcessor


class BanSeven(LogitsProcessor):
    def __call__(self, token_ids, logits):
        logits[7] = float("-inf")
        return logits
{FENCE}

{FENCE}python example=ban test
import torch
from vframe.plugins import get_registry


def test_bans_seven():
    processor = get_registry("logits_processor").load("doc_ban_seven")()
    assert processor([], torch.zeros(10))[7] == float("-inf")
{FENCE}

{FENCE}python example=broken file=doc_broken.py
ANSWER = 41
{FENCE}

{FENCE}python example=broken test
from doc_broken import ANSWER

assert ANSWER == 42, "the doc promised 42"
{FENCE}
"""


def test_harness_runs_a_working_example_as_an_installed_plugin(tmp_path: Path) -> None:
    from vframe.plugins import get_registry, loaded_plugins

    examples = parse_examples(SAMPLE_MD)
    assert list(examples) == ["ban", "broken"]
    assert [b.file for b in examples["ban"].files] == [
        "pyproject.toml",
        "src/vframe_doc_ban/__init__.py",
        "src/vframe_doc_ban/processor.py",
    ]
    assert entry_points(examples["ban"]) == {"doc_ban": "vframe_doc_ban"}
    run_example(examples["ban"], tmp_path)
    # Afterwards nothing of it is left behind.
    assert "doc_ban" not in loaded_plugins()
    assert "doc_ban_seven" not in get_registry("logits_processor").names()
    assert not any(name.startswith("vframe_doc_ban") for name in sys.modules)


def test_harness_fails_an_example_whose_code_raises(tmp_path: Path) -> None:
    example = parse_examples(SAMPLE_MD)["broken"]
    with pytest.raises(AssertionError, match="the doc promised 42") as raised:
        run_example(example, tmp_path, source="sample.md")
    # The traceback names the Markdown line of the failing assert.
    line = SAMPLE_MD.splitlines().index('assert ANSWER == 42, "the doc promised 42"') + 1
    last = traceback.extract_tb(raised.value.__traceback__)[-1]
    assert (last.filename, last.lineno) == ("sample.md", line)
    assert "doc_broken" not in sys.modules


@pytest.mark.parametrize(
    ("markdown", "message"),
    [
        (f"{FENCE}python example=lonely file=a.py\nx = 1\n{FENCE}\n", "has no ```python example=lonely test"),
        (f"{FENCE}python example=x\nx = 1\n{FENCE}\n", "exactly one of file=PATH or test"),
        (f"{FENCE}python example=x tset\nx = 1\n{FENCE}\n", "unknown option"),
        (f"{FENCE}python example=x file=../escape.py\nx = 1\n{FENCE}\n", "relative path inside"),
    ],
)
def test_harness_rejects_malformed_blocks(markdown: str, message: str) -> None:
    with pytest.raises(DocExampleError, match=re.escape(message)):
        parse_examples(markdown)


def test_harness_refuses_test_functions_that_want_fixtures(tmp_path: Path) -> None:
    markdown = f"{FENCE}python example=x test\ndef test_it(tmp_path):\n    pass\n{FENCE}\n"
    with pytest.raises(DocExampleError, match="takes arguments"):
        run_example(parse_examples(markdown)["x"], tmp_path)


def test_harness_checks_the_pyproject_declares_vframe_entry_points() -> None:
    markdown = (
        f'{FENCE}toml example=x file=pyproject.toml\n[project]\nname = "x"\n{FENCE}\n'
        f"{FENCE}python example=x test\npass\n{FENCE}\n"
    )
    with pytest.raises(DocExampleError, match=re.escape("declares no [project.entry-points.vframe]")):
        entry_points(parse_examples(markdown)["x"])
