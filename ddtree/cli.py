"""The `ddtree` command. Subcommands import their heavy dependencies (torch) only when they run,
so client commands work on machines without torch."""

from __future__ import annotations

import argparse
import sys

from ddtree.client_cli import add_client_commands


def _make_tiny_model(args: argparse.Namespace) -> None:
    from pathlib import Path

    from modeling.tiny import make_tiny_drafter, make_tiny_target

    target = make_tiny_target(Path(args.directory) / "target", seed=args.seed)
    drafter = make_tiny_drafter(Path(args.directory) / "dflash", target, seed=args.seed + 1)
    print(f"tiny target: {target}\ntiny DFlash drafter: {drafter}")


def _offline(args: argparse.Namespace) -> None:
    import json

    from ddtree.offline import generate_offline
    from drafter_service.server import load_drafter
    from modeling.config import ModelConfig
    from verifier_service.engine.config import EngineConfig
    from verifier_service.engine.engine import Engine
    from verifier_service.engine.sampling import SamplingParams

    dtype = args.dtype or ModelConfig.from_dir(args.target).torch_dtype
    engine = Engine.from_checkpoint(args.target, EngineConfig(
        page_size=args.page_size, kv_budget_bytes=args.kv_budget_mb << 20, dtype=dtype, device=args.device,
        attention=args.attention))
    drafter = None
    if args.drafter != "none":
        drafter = load_drafter(args.drafter, args.target, args.device, dtype, args.context_window or None)
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    elif engine.tokenizer is not None:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        raise SystemExit("the target has no tokenizer.json: pass --prompt-ids")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos)
    result = generate_offline(engine, drafter, prompt, params, args.tree_budget)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        summary = result.to_json()
        print(result.text)
        print(f"\n[{len(result.token_ids)} tokens, {summary['steps']} steps, mean acceptance "
              f"{summary['mean_acceptance_length']:.2f}, {result.tokens_per_s:.1f} tokens/s, "
              f"stop: {result.stop_reason}]", file=sys.stderr)


DEMO_PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


def _serve(args: argparse.Namespace) -> None:
    import signal

    from ddtree.local_stack import LocalStack, ensure_tiny_model

    target, drafter = args.target, args.drafter
    if target is None:
        tiny_target, tiny_drafter = ensure_tiny_model()
        target, drafter = str(tiny_target), drafter or str(tiny_drafter)
    stack = LocalStack(target, drafter or "ngram", args.drafters, args.device, args.listen, log_dir=args.log_dir)
    print(f"starting {args.drafters} drafter(s) ({stack.drafter}), verifier and gateway for {target} ...",
          file=sys.stderr)
    with stack:
        print(f"gateway listening on {args.listen}", flush=True)
        if args.demo:
            _demo(args.listen)
            return
        # NOTE: block only now: children inherit the signal mask, and they must stay stoppable.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})


def _demo(gateway: str) -> None:
    from ddtree.client import Client

    generation = Client(gateway).generate(DEMO_PROMPT, max_new_tokens=32)
    print(f"> {DEMO_PROMPT}")
    for chunk in generation:
        print(chunk.text, end="", flush=True)
    summary = generation.summary
    print(f"\n[{summary.generated_tokens} tokens, mean acceptance {summary.mean_acceptance_length:.2f}, "
          f"TTFT {summary.ttft_ms:.0f} ms, {summary.tokens_per_second:.1f} tokens/s]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding over gRPC")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("make-tiny-model", help="write a small random Qwen3 target (DIR/target) and "
                               "DFlash drafter (DIR/dflash) in HF formats")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
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
    offline.add_argument("--attention", default="torch", choices=["torch", "triton"])
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
    serve.add_argument("--log-dir", help="write each process's log here")
    serve.add_argument("--demo", action="store_true", help="send one sample request, print it, stop")
    serve.set_defaults(run=_serve)

    add_client_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
