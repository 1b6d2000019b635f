"""Writing small GGUF files with the ``gguf`` package, for the tests of the GGUF loader
(tests/models/test_gguf_models.py, tests/models/test_loader.py) and the ``gguf`` quantizer
(tests/quant/test_gguf.py)."""

from __future__ import annotations

from typing import Any


def add_toy_vocabulary(writer: Any, vocab: int) -> None:
    """A byte-level GPT-2 vocabulary of ``vocab`` tokens (``!``, ``"``, ... and the one merge
    ``!"``), BOS 0, EOS 1: enough for transformers to build the file's tokenizer."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("!") + i) for i in range(vocab - 1)] + ['!"'])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)


def write_out(writer: Any) -> None:
    """Header, metadata and tensors to the writer's file, which is then closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
