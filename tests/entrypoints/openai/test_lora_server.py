"""LoRA adapters through a real ``vframe serve``: ``--lora-modules``, ``/v1/models``,
``model=<adapter>``, and the run-time load/unload endpoints.

The adapters are real PEFT adapters made at test time on the embedded SmolLM2
(``init_lora_weights=False``, B scaled by 0.5: enough to change a short greedy text).
A greedy completion through the server must equal the offline
``LLM(enable_lora=True)`` output for the same adapter and prompt.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from openai_server import SERVER_FLAGS, Server, start_server, stop_server
from safetensors.torch import load_file, save_file

from vframe import LLM, LoRARequest, SamplingParams
from vframe.core.engine import EMBEDDED_MODEL_NAME

# name -> (rank, target modules)
ADAPTERS = {"sql": (8, ["q_proj", "v_proj"]), "chat": (4, ["gate_proj", "down_proj"]), "wide": (16, ["q_proj"])}
LORA_FLAGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4"]
PROMPT = [1, 504, 3458, 282, 4649, 314]  # token ids of the embedded tokenizer
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, hf_smollm) -> dict[str, str]:
    """Adapter directories: sql (rank 8), chat (rank 4), wide (rank 16, above the server's
    max_lora_rank) and other_base (sql with a q_proj B of the wrong shape)."""
    from peft import LoraConfig, get_peft_model

    paths = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(copy.deepcopy(hf_smollm), config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.5)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(path))
        paths[name] = str(path)
    other = tmp_path_factory.mktemp("other_base")
    shutil.copy(Path(paths["sql"]) / "adapter_config.json", other)
    tensors = load_file(Path(paths["sql"]) / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.self_attn.q_proj.lora_B" in k)
    tensors[key] = tensors[key][: tensors[key].shape[0] // 2].contiguous()  # [576, 8] -> [288, 8]
    save_file(tensors, other / "adapter_model.safetensors")
    paths["other_base"] = str(other)
    return paths


@pytest.fixture(scope="module")
def offline(adapters: dict[str, str]) -> dict[str | None, str]:
    """Greedy texts of PROMPT offline: the base model and each served adapter."""
    llm = LLM(dtype="float32", max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8)
    sql, chat = LoRARequest("sql", 1, adapters["sql"]), LoRARequest("chat", 2, adapters["chat"])
    loras = {None: None, "sql": sql, "chat": chat}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    prompts = [{"prompt_token_ids": PROMPT}] * len(loras)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=list(loras.values()))
    return {name: out.outputs[0].text for name, out in zip(loras, outputs)}


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, str]) -> Iterator[Server]:
    chat = json.dumps({"name": "chat", "path": adapters["chat"], "base_model_name": EMBEDDED_MODEL_NAME})
    srv = start_server(
        tmp_path_factory.mktemp("lora-serve"), *LORA_FLAGS, "--lora-modules", f"sql={adapters['sql']}", chat,
        env={"VFRAME_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )
    yield srv
    stop_server(srv.process)


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0).choices[0].text


def test_models_lists_the_adapters_with_their_parent(lora_server: Server, adapters: dict[str, str]):
    with lora_server.client() as client:
        cards = {m.id: m.model_dump() for m in client.models.list().data}
        assert list(cards) == [EMBEDDED_MODEL_NAME, "sql", "chat"]
        assert cards["sql"]["parent"] == cards["chat"]["parent"] == EMBEDDED_MODEL_NAME
        assert cards["sql"]["root"] == adapters["sql"]
        assert cards[EMBEDDED_MODEL_NAME]["parent"] is None
        assert client.models.retrieve("chat").model_dump()["root"] == adapters["chat"]


def test_a_completion_runs_with_the_adapter_it_names(lora_server: Server, offline: dict[str | None, str]):
    assert offline["sql"] != offline[None] and offline["chat"] != offline[None]
    with lora_server.client() as client:
        for name in ("sql", "chat"):
            response = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            assert response.model == name
            assert response.choices[0].text == offline[name]
        assert complete(client, EMBEDDED_MODEL_NAME) == offline[None]
        chat = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
        )
        assert chat.model == "sql" and chat.choices[0].message.content


def test_an_unknown_model_is_404(lora_server: Server):
    with lora_server.client() as client, pytest.raises(openai.NotFoundError) as info:
        complete(client, "nope")
    assert info.value.status_code == 404
    assert "The model 'nope' does not exist" in info.value.message
    assert "'sql'" in info.value.message


def test_load_and_unload_at_run_time(lora_server: Server, adapters: dict[str, str], offline: dict[str | None, str]):
    response = lora_server.post("/v1/load_lora_adapter", json={"lora_name": "sql2", "lora_path": adapters["sql"]})
    assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'sql2' added successfully.")
    with lora_server.client() as client:
        assert [m.id for m in client.models.list().data] == [EMBEDDED_MODEL_NAME, "sql", "chat", "sql2"]
        assert complete(client, "sql2") == offline["sql"]
        response = lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "sql2"})
        assert (response.status_code, response.text) == (200, "Success: LoRA adapter 'sql2' removed successfully.")
        assert "sql2" not in [m.id for m in client.models.list().data]
        with pytest.raises(openai.NotFoundError):
            complete(client, "sql2")


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("load", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ("load", {"lora_name": "sql", "lora_path": "{sql}"}, 400, "The lora adapter 'sql' has already been loaded."),
        ("load", {"lora_name": "x", "lora_path": "/nonexistent"}, 400, "adapter 'x' (/nonexistent) has no"),
        ("load", {"lora_name": "x", "lora_path": "{wide}"}, 400, "max_lora_rank"),
        ("load", {"lora_name": "x", "lora_path": "{other_base}"}, 400, "this model expects [576, 8]"),
        ("unload", {}, 400, "'lora_name' needs to be provided"),
        ("unload", {"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found."),
    ],
)
def test_load_and_unload_errors(lora_server: Server, adapters: dict[str, str], path, body, status, message):
    body = {k: v.format(**adapters) for k, v in body.items()}
    response = lora_server.post(f"/v1/{path}_lora_adapter", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


def test_an_adapter_in_use_is_not_unloaded(lora_server: Server):
    with lora_server.client() as client:
        stream = client.completions.create(
            model="chat", prompt=PROMPT, max_tokens=300, temperature=0.0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # the request is running
        response = lora_server.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        stream.close()
    assert response.status_code == 400
    assert "in use by requests in flight" in response.json()["error"]["message"]


def test_without_enable_lora_and_without_the_flag(tmp_path: Path, server: Server):
    """The shared plain server (no --enable-lora, no VFRAME_ALLOW_RUNTIME_LORA_UPDATING):
    the endpoints do not exist. --lora-modules without --enable-lora is refused before loading."""
    assert server.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"}).status_code == 404
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    proc = subprocess.run(
        [sys.executable, "-m", "vframe.entrypoints.cli", "serve", "--lora-modules", "a=/a"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "vframe: error: --lora-modules needs --enable-lora" in proc.stderr


def test_a_bad_module_stops_the_server_at_start_up(tmp_path: Path, adapters: dict[str, str]):
    proc = subprocess.run(
        [sys.executable, "-m", "vframe.entrypoints.cli", "serve", "--port", "0", *SERVER_FLAGS, *LORA_FLAGS,
         "--lora-modules", f"sql={adapters['sql']}", f"wide={adapters['wide']}"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert f"vframe: error: adapter 'wide' ({adapters['wide']})" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_load_without_enable_lora_is_refused(tmp_path: Path):
    srv = start_server(tmp_path, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        response = srv.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    finally:
        stop_server(srv.process)
    assert response.status_code == 400
    assert "LoRA is not enabled" in response.json()["error"]["message"]
