"""`ddtree generate` and `ddtree session ...`: the gateway from the terminal (no torch needed). `ddtree chat`
(ddtree/chat.py) shares their connection and sampling options and their streaming."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from typing import TextIO

from google.protobuf.json_format import MessageToDict

from ddtree.client import DEFAULT_GATEWAY, Client, GatewayError, Generation
from ddtree.progress import Progress
from proto import common_pb2
from proto.security import add_client_tls_args, client_tls

# C0 and C1 controls and DEL, newline and tab aside: what lets text move the cursor, retitle a window or ring
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def for_terminal(text: str, stream: TextIO | None = None) -> str:
    """Model output as printed to `stream` (default stdout): on a terminal its control characters are escaped
    (ESC as \\x1b), so generated text cannot drive the terminal; to a pipe or file it goes unchanged."""
    if not (stream or sys.stdout).isatty():
        return text
    return _CONTROL_CHARACTERS.sub(lambda match: f"\\x{ord(match.group()):02x}", text)


def add_client_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate` and `session` to the main CLI's subcommands."""
    gen = subparsers.add_parser("generate", help="generate text through the gateway, streaming it")
    gen.add_argument("text")
    gen.add_argument("--session", help="continue this session handle with the text")
    gen.add_argument("--keep-session", action="store_true", help="keep a new session; print its handle")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    gen.add_argument("--tree-budget", type=int, default=0,
                     help="draft tree nodes per step for this call; 0 = the verifier's policy")
    sampling_args(gen)
    connection_args(gen)
    gen.set_defaults(run=guarded(_generate))

    session = subparsers.add_parser("session", help="KV state handles on the gateway")
    actions = session.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="prefill text; print the new handle")
    create.add_argument("text")
    for name, help_text in (("fork", "a new handle sharing the session's prefix; print it"),
                            ("release", "free the session"), ("get", "print the session as JSON")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("handle")
    actions.add_parser("list", help="print the caller's sessions as JSON lines")
    for action in actions.choices.values():
        connection_args(action)
        action.set_defaults(run=guarded(_session))


def sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=0, help="0 = the server's default")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def sampling_options(args: argparse.Namespace) -> dict:
    """The options of `sampling_args`, as `Client.generate` and `Client.chat` take them."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default=os.environ.get("DDTREE_GATEWAY", DEFAULT_GATEWAY),
                        help="gateway address (env DDTREE_GATEWAY)")
    parser.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY"), help="API key (env DDTREE_API_KEY)")
    parser.add_argument("--timeout", type=float, help="deadline of the call, in seconds")
    add_client_tls_args(parser)


def guarded(command: Callable[[argparse.Namespace, Client], None]) -> Callable[[argparse.Namespace], None]:
    """Run with a client; a gateway error becomes a one-line message and exit status 1 (a certificate file that
    cannot be used: status 2)."""
    def run(args: argparse.Namespace) -> None:
        try:
            client = Client(args.gateway, api_key=args.api_key, timeout=args.timeout, tls=client_tls(args))
        except ValueError as error:  # NOTE: its message names the file and the problem
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        with client:
            try:
                command(args, client)
            except GatewayError as error:
                print(f"error: {error}", file=sys.stderr)
                raise SystemExit(1) from None
    return run


def stream(generation: Generation, echo: bool = True) -> None:
    """Read the generation to its end, printing each chunk's text as it comes when `echo`; before the first, a
    long prefill's progress on stderr (a bar on a terminal, erased when the text starts)."""
    prefill: Progress | None = None
    try:
        for event in generation.events():
            if isinstance(event, common_pb2.PrefillProgress):
                prefill = prefill or Progress("prefill", event.total_tokens, unit="tokens", transient=True)
                prefill.update(event.prefilled_tokens)
                continue
            if prefill is not None:
                prefill.close()
                prefill = None
            if echo:
                print(for_terminal(event.text), end="", flush=True)
    finally:
        if prefill is not None:
            prefill.close(finished=False)


def _generate(args: argparse.Namespace, client: Client) -> None:
    generation = client.generate(args.text, session=args.session, keep_session=args.keep_session,
                                 tree_budget=args.tree_budget, **sampling_options(args))
    try:
        stream(generation, echo=not args.json)
    except KeyboardInterrupt:
        generation.cancel()
        raise SystemExit(130) from None
    except GatewayError:
        if generation.text and not args.json:
            print(flush=True)  # the partial text ends its line; _guarded prints the status and message
        raise
    summary = generation.summary
    if summary is None or summary.stop_reason == common_pb2.STOP_REASON_ERROR:  # NOTE: older gateways sent these
        if generation.text and not args.json:
            print(flush=True)
        print(f"error: the generation failed after {len(generation.token_ids)} tokens (no status from the gateway)",
              file=sys.stderr)
        raise SystemExit(1)
    stop_reason = common_pb2.StopReason.Name(summary.stop_reason).removeprefix("STOP_REASON_").lower()
    if args.json:
        print(json.dumps({
            "text": generation.text, "token_ids": generation.token_ids,
            "acceptance_lengths": generation.acceptance_lengths, "stop_reason": stop_reason,
            "session": summary.session,
            "timings": {"ttft_ms": summary.ttft_ms, "e2e_ms": summary.e2e_ms,
                        "tokens_per_second": summary.tokens_per_second},
            "prompt_tokens": summary.prompt_tokens, "generated_tokens": summary.generated_tokens,
            "mean_acceptance_length": summary.mean_acceptance_length,
        }))
        return
    print()
    kept = f", session {summary.session}" if summary.session else ""
    print(f"[{summary.generated_tokens} tokens, {stop_reason}, ttft {summary.ttft_ms:.0f} ms, "
          f"{summary.tokens_per_second:.1f} tok/s, acceptance {summary.mean_acceptance_length:.2f}{kept}]",
          file=sys.stderr)


def _session(args: argparse.Namespace, client: Client) -> None:
    if args.action == "create":
        print(client.create_session(args.text).session.session)
    elif args.action == "fork":
        print(client.fork_session(args.handle).session)
    elif args.action == "release":
        client.release_session(args.handle)
    elif args.action == "get":
        print(json.dumps(_as_dict(client.get_session(args.handle))))
    else:
        for info in client.list_sessions():
            print(json.dumps(_as_dict(info)))


def _as_dict(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
