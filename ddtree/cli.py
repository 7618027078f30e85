"""The `ddtree` command. Subcommands import their heavy dependencies (torch) only when they run,
so client commands work on machines without torch."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, NoReturn

from ddtree.bench_cli import add_bench_command
from ddtree.chat import add_chat_command
from ddtree.client_cli import add_client_commands, for_terminal
from ddtree.local_stack import add_forwarded_options, forwarded_args

if TYPE_CHECKING:
    from ddtree.offline import OfflineResult

# NOTE: modeling.tiny.TINY_CONFIGS' keys, spelled out: parsing must not import torch (tests/test_cli.py checks).
TINY_ARCHS = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "qwen3")


def _make_tiny_model(args: argparse.Namespace) -> None:
    from pathlib import Path

    from modeling.tiny import make_tiny_drafter, make_tiny_target

    target = make_tiny_target(Path(args.directory) / "target", seed=args.seed, arch=args.arch)
    drafter = make_tiny_drafter(Path(args.directory) / "dflash", target, seed=args.seed + 1)
    print(f"tiny target: {target}\ntiny DFlash drafter: {drafter}")


def _fail(message: str, status: int = 2) -> NoReturn:
    """A failure the user can fix: one line, no traceback (status 2, as argparse's, for bad parameters)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)


def _offline(args: argparse.Namespace) -> None:
    import json

    from proto.serving import describe

    try:
        result = _run_offline(args)
    except (ValueError, OSError) as error:  # NOTE: bad values and missing checkpoints; their messages name them
        _fail(describe(error))
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        summary = result.to_json()
        print(for_terminal(result.text))
        print(f"\n[{len(result.token_ids)} tokens, {summary['steps']} steps, mean acceptance "
              f"{summary['mean_acceptance_length']:.2f}, {result.tokens_per_s:.1f} tokens/s, "
              f"stop: {result.stop_reason}]", file=sys.stderr)


def _run_offline(args: argparse.Namespace) -> OfflineResult:
    import torch

    from ddtree.offline import generate_offline
    from drafter_service.server import load_drafter
    from modeling.config import ModelConfig
    from verifier_service.engine.config import EngineConfig, resolve_attention
    from verifier_service.engine.engine import Engine
    from verifier_service.engine.sampling import SamplingParams

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: this machine (torch {torch.__version__}) has no CUDA device")
    model = ModelConfig.from_dir(args.target)
    engine = Engine.from_checkpoint(args.target, EngineConfig(
        page_size=args.page_size, kv_budget_bytes=args.kv_budget_mb << 20, dtype=args.dtype or model.torch_dtype,
        device=args.device, attention=resolve_attention(args.attention, args.device)))
    dtype = engine.config.dtype
    drafter = None
    if args.drafter != "none":
        drafter = load_drafter(args.drafter, args.target, args.device, dtype, args.context_window or None)
    if args.prompt_ids:
        prompt = _token_ids(args.prompt_ids)
    elif engine.tokenizer is not None:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        raise ValueError("the target has no tokenizer.json: pass --prompt-ids")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    # NOTE: the engine checks the sampling parameters and the prompt's ids against the vocabulary (ValueError)
    return generate_offline(engine, drafter, prompt, params, args.tree_budget)


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated token ids, got {text!r}") from None


DEMO_PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


def _serve(args: argparse.Namespace) -> None:
    import logging
    import signal

    from ddtree.client import GatewayError
    from ddtree.local_stack import LocalStack, StartFailed, ensure_tiny_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # NOTE: progress lines, off a terminal

    target, drafter = args.target, args.drafter
    if target is None:
        tiny_target, tiny_drafter = ensure_tiny_model()
        target, drafter = str(tiny_target), drafter or str(tiny_drafter)
    forwarded = forwarded_args(args)
    stack = LocalStack(target, drafter or "ngram", args.drafters, args.device, args.listen,
                       verifier_args=forwarded["verifier"], drafter_args=forwarded["drafter"],
                       gateway_args=forwarded["gateway"], log_dir=args.log_dir)
    print(f"starting {args.drafters} drafter(s) ({stack.drafter}), verifier and gateway for {target} "
          f"(logs in {stack.log_dir}) ...", file=sys.stderr)
    try:
        with stack:
            http = f", OpenAI-compatible HTTP API at {stack.http_url}" if stack.http_url else ""
            print(f"gateway listening on {args.listen} (gRPC){http}", flush=True)
            _print_readiness(stack.addresses)
            if args.demo:
                _demo(args.listen)
                return
            # NOTE: block only now: children inherit the signal mask, and they must stay stoppable.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except StartFailed as error:
        _fail(str(error), status=1)
    except GatewayError as error:
        _fail(f"the demo request failed: {error} (logs in {stack.log_dir})", status=1)
    except KeyboardInterrupt:  # while starting: the stack is stopped already
        raise SystemExit(130) from None


def _print_readiness(addresses: dict[str, str]) -> None:
    """The status block, then a line for whatever is not ready (or one saying that all is)."""
    from ddtree.readiness import wait_ready

    readiness = wait_ready(addresses)
    print(readiness.block())
    print("\n".join(f"not ready: {problem}" for problem in readiness.problems) or "ready", flush=True)


def _demo(gateway: str) -> None:
    from ddtree.client import Client

    generation = Client(gateway).generate(DEMO_PROMPT, max_new_tokens=32)
    print(f"> {DEMO_PROMPT}")
    for chunk in generation:
        print(for_terminal(chunk.text), end="", flush=True)
    summary = generation.summary
    print(f"\n[{summary.generated_tokens} tokens, mean acceptance {summary.mean_acceptance_length:.2f}, "
          f"TTFT {summary.ttft_ms:.0f} ms, {summary.tokens_per_second:.1f} tokens/s]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="write a small random target (DIR/target) and "
                               "DFlash drafter (DIR/dflash) in HF formats")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", default="qwen3", choices=TINY_ARCHS, help="the target's architecture")
    tiny.set_defaults(run=_make_tiny_model)

    offline = commands.add_parser("offline", help="run the whole speculative loop in this process")
    offline.add_argument("--target", required=True, help="HF checkpoint directory of the target")
    offline.add_argument("--drafter", default="ngram", help="DFlash checkpoint directory, 'ngram' or 'none'")
    prompt = offline.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    offline.add_argument("--max-new-tokens", type=int, default=64)
    offline.add_argument("--temperature", type=float, default=0.0)
    offline.add_argument("--top-k", type=int, default=0)
    offline.add_argument("--top-p", type=float, default=1.0)
    offline.add_argument("--seed", type=int, default=None)
    offline.add_argument("--ignore-eos", action="store_true")
    offline.add_argument("--tree-budget", type=int, default=15)
    offline.add_argument("--context-window", type=int, default=1024, help="drafter window W; 0 = unlimited")
    offline.add_argument("--device", default="cpu")
    offline.add_argument("--dtype", default=None)
    offline.add_argument("--attention", default="auto", choices=("auto", "torch", "triton"),
                         help="auto: triton on CUDA, torch on the CPU")
    offline.add_argument("--page-size", type=int, default=64)
    offline.add_argument("--kv-budget-mb", type=int, default=256)
    offline.add_argument("--json", action="store_true", help="print one JSON object")
    offline.set_defaults(run=_offline)

    serve = commands.add_parser("serve", help="start gateway, verifier and drafters as local processes")
    serve.add_argument("--target", help="HF checkpoint directory (default: the tiny built-in model)")
    serve.add_argument("--drafter", help="DFlash checkpoint directory or 'ngram' (default: the tiny DFlash "
                       "drafter with the built-in model, else ngram)")
    serve.add_argument("--drafters", type=int, default=1, help="drafter replicas")
    serve.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    serve.add_argument("--listen", default="127.0.0.1:50051", help="the gateway's address")
    serve.add_argument("--log-dir", help="write each process's log here (created if missing; default: a new "
                       "temporary directory)")
    serve.add_argument("--demo", action="store_true", help="send one sample request, print it, stop")
    add_forwarded_options(serve)
    serve.set_defaults(run=_serve)

    add_client_commands(commands)
    add_chat_command(commands)
    add_bench_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
