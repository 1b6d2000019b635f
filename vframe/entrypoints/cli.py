"""The ``vframe`` command line: generate, serve, plugins, bench."""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any

from vframe.core.config import FLAT_FIELDS, EngineConfig

_SAMPLING_FLAGS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "seed": int,
    "max_tokens": int,
    "min_tokens": int,
    "n": int,
    "logprobs": int,
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per engine setting, named as in vLLM (``--max-num-seqs``).
    A flag the command already defines (``--model``, a sampling ``--seed``) keeps its meaning."""
    group = parser.add_argument_group("engine settings (see docs/configuration.md)")
    group.add_argument("--config", dest="config_file", help="YAML or TOML file of engine settings")
    for name, section in FLAT_FIELDS.items():
        if "--" + name.replace("_", "-") in parser._option_string_actions:
            continue
        field = getattr(EngineConfig.model_fields[section].annotation, "model_fields")[name]
        flag = "--" + name.replace("_", "-")
        help_text = field.description or f"{section} setting"
        if field.annotation is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            continue
        choices = _literal_choices(field.annotation)
        group.add_argument(flag, dest=name, default=None, choices=choices, help=help_text)


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in FLAT_FIELDS:
        value = getattr(args, name, None)
        if value is None:
            continue
        kwargs[name] = [p for p in value.split(",") if p] if name == "plugins" else value
    return kwargs


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vframe",
        description="vframe: an LLM inference and serving engine built as a small core plus plugins.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text for a prompt or answer a chat message",
        description="Generate a completion for --prompt, or a chat reply to --message "
        "(formatted with the model's chat template). Without --model the embedded "
        "SmolLM2-135M-Instruct is used.",
    )
    gen.add_argument("--model", default=None, help="GGUF file or Hugging Face directory")
    what = gen.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", action="append", help="a raw prompt (repeatable)")
    what.add_argument("--message", action="append", help="a user chat message (repeatable: one conversation each)")
    gen.add_argument("--system", default=None, help="system message for --message")
    samp = gen.add_argument_group("sampling")
    for name, typ in _SAMPLING_FLAGS.items():
        samp.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None)
    samp.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    samp.add_argument("--ignore-eos", action="store_true", default=None)
    gen.add_argument("--json", action="store_true", help="print the outputs as JSON")
    add_engine_args(gen)

    plugins = sub.add_parser(
        "plugins",
        help="list everything registered, where it came from and whether it is usable here",
        description="List every registered model, attention backend, scheduler, KV cache "
        "manager, sampler, model runner, quantizer and logits processor; the plugin that "
        "registered it; whether it can be used on this machine and, if not, why. Plugins "
        "that failed to load are listed with their error.",
    )
    plugins.add_argument("--plugins", default=None, help="allow-list of entry-point plugins (comma-separated)")
    plugins.add_argument(
        "--check",
        metavar="NAME",
        default=None,
        help="run the conformance kit's quick checks (vframe.testing) on the registry entry NAME (and, "
        "when NAME is a plugin with lifecycle hooks, on those) and print PASS, FAIL or SKIP per check; "
        "exit status 0 when at least one check passed and none failed",
    )
    from vframe.plugins.registry import KINDS

    plugins.add_argument(
        "--kind",
        choices=[*KINDS, "lifecycle"],
        default=None,
        help="with --check: only the entry of this kind ('lifecycle': NAME is a plugin with lifecycle hooks)",
    )

    from vframe.entrypoints.openai.args import add_serve_args

    serve = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (default: the embedded SmolLM2-135M-Instruct) on /v1/completions, "
        "/v1/chat/completions and friends (see docs/serving.md). SIGTERM drains in-flight requests.",
    )
    add_serve_args(serve)
    add_engine_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (see docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="WORKLOAD")
    from vframe.bench.throughput import add_throughput_args

    tp = bench_sub.add_parser(
        "throughput",
        help="the offline workload: 64 prompts of 32-512 tokens, 128 output tokens each",
        description="Run the offline workload of BENCHMARK.md on vframe and, with --backend, on "
        "transformers (hf: static batches) and vLLM (vllm: in --peer-python), printing output tokens/s "
        "and vframe's ratio to each.",
    )
    add_throughput_args(tp)
    add_engine_args(tp)
    from vframe.bench.latency import add_latency_args

    lt = bench_sub.add_parser(
        "latency",
        help="the latency workload: 1 request, 256-token prompt, 128 output tokens: TTFT and TPOT",
        description="Run the latency workload of BENCHMARK.md (one streamed request, best of 3) on vframe "
        "and, with --backend, on transformers (hf) and vLLM (vllm: in --peer-python), printing time to first "
        "token, time per output token and vframe's ratio to each.",
    )
    add_latency_args(lt)
    add_engine_args(lt)
    from vframe.bench.shared_prefix import add_shared_prefix_args

    sp = bench_sub.add_parser(
        "shared-prefix",
        help="64 prompts sharing a 1,024-token prefix: prefix caching on vs off",
        description="Run the shared-prefix workload of BENCHMARK.md twice, with prefix caching "
        "on and off, printing output tokens/s for both and their ratio.",
    )
    add_shared_prefix_args(sp)
    add_engine_args(sp)
    from vframe.bench.serve import add_bench_serve_args

    bs = bench_sub.add_parser(
        "serve",
        help="the serving workload: the offline prompts streamed at concurrency 1, 4 and 16",
        description="Send the offline workload's prompts to an OpenAI-compatible server (--base-url, "
        "or a vframe server started for the run) from concurrent streaming clients and report "
        "request/s, output tokens/s, TTFT, TPOT and ITL.",
    )
    add_bench_serve_args(bs)
    add_engine_args(bs)
    from vframe.bench.lora import add_bench_lora_args

    bl = bench_sub.add_parser(
        "lora",
        help="the offline workload with 4 LoRA adapters of rank 16 round-robin vs the base model",
        description="Run the offline workload on the base model, on a LoRA-enabled engine with "
        "base-model requests, and with random adapters assigned round-robin, in one run, printing "
        "output tokens/s of each and the loss 1 - lora / base.",
    )
    add_bench_lora_args(bl)
    add_engine_args(bl)
    from vframe.bench.attention import add_bench_attention_args

    ba = bench_sub.add_parser(
        "attention",
        help="each attention backend against the plain-PyTorch one: time per call and max error",
        description="Time one attention step (write the new tokens' keys and values, attend) of every "
        "available attention backend, or --backends, over decode and prefill shapes, against the torch "
        "backend on the same data: median ms per call, speedup and max abs error vs torch.",
    )
    add_bench_attention_args(ba)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    import json

    from vframe import LLM, SamplingParams

    sp_kwargs = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    if args.stop:
        sp_kwargs["stop"] = args.stop
    if args.ignore_eos:
        sp_kwargs["ignore_eos"] = True
    sp_kwargs.setdefault("max_tokens", 128)
    params = SamplingParams(**sp_kwargs)
    llm = LLM(config_file=args.config_file, **({"model": args.model} | engine_kwargs(args)))
    if args.prompt:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        conversations = [system + [{"role": "user", "content": m}] for m in args.message]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    if args.json:
        print(json.dumps([_output_dict(o) for o in outputs], indent=2))
        return 0
    for out in outputs:
        for comp in out.outputs:
            print(comp.text.strip() if len(out.outputs) == 1 else f"[{comp.index}] {comp.text.strip()}")
    return 0


def _output_dict(out) -> dict[str, Any]:
    return {
        "request_id": out.request_id,
        "prompt": out.prompt,
        "outputs": [
            {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            for c in out.outputs
        ],
    }


def _cmd_plugins(args: argparse.Namespace) -> int:
    from vframe.plugins.manager import load_plugins
    from vframe.plugins.report import describe_plugins, format_plugins

    if args.plugins is not None:
        load_plugins([p for p in args.plugins.split(",") if p])
    if args.check is not None:
        from vframe.testing.quick import report_quick_checks

        return report_quick_checks(args.check, args.kind, print_line=lambda line: print(line, flush=True))
    if args.kind is not None:
        print("vframe: error: --kind only applies with --check NAME", file=sys.stderr)
        return 2
    print(format_plugins(describe_plugins()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    from vframe.errors import VFrameError

    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "plugins":
            return _cmd_plugins(args)
        if args.command == "serve":
            from vframe.entrypoints.openai.api_server import run_server

            return run_server(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "serve":
            from vframe.bench.serve import run_bench_serve

            return run_bench_serve(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "throughput":
            from vframe.bench.throughput import run_throughput

            return run_throughput(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "latency":
            from vframe.bench.latency import run_latency

            return run_latency(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "shared-prefix":
            from vframe.bench.shared_prefix import run_shared_prefix

            return run_shared_prefix(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "lora":
            from vframe.bench.lora import run_bench_lora

            return run_bench_lora(args, engine_kwargs(args))
        if args.command == "bench" and args.bench_command == "attention":
            from vframe.bench.attention import run_bench_attention

            return run_bench_attention(args)
    except VFrameError as e:
        print(f"vframe: error: {e}", file=sys.stderr)
        return 2
    parser.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
