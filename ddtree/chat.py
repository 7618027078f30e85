"""`ddtree chat`: talk to the model on a running gateway, turn by turn, in one KV session.

Each turn sends only the new user message through the gateway's Chat call, with the conversation's session
handle: the gateway renders it with the model's chat template as the turns after the session's last reply and
appends it, so the history is never sent or prefilled again. Commands: /fork continues on a copy-on-write fork
(the old handle stays as it was, for `--session`), /reset starts a new conversation, /stats shows acceptance and
speed. Ctrl-C stops the answer being written; the session keeps what was generated up to there.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass

from ddtree.client import Client, GatewayError, Generation
from ddtree.client_cli import connection_args, guarded, sampling_args, sampling_options, stream

HELP = """/fork   continue on a fork of the session (the current one stays as it is)
/reset  start a new conversation (the session is released)
/stats  acceptance and speed of the answers so far
/quit   leave (Ctrl-D too); Ctrl-C stops an answer"""
IDLE_WAIT_S = 10.0  # how long a stopped answer may take to let go of its session


@dataclass
class Stats:
    """The answers of one conversation, as they arrived here."""

    answers: int = 0
    tokens: int = 0
    steps: int = 0
    accepted: int = 0  # the steps' acceptance lengths, summed
    decode_tokens: int = 0  # tokens after each answer's first, over
    decode_s: float = 0.0  # the time from each answer's first token to its last

    def add(self, generation: Generation) -> None:
        self.answers += 1
        self.tokens += len(generation.token_ids)
        self.steps += len(generation.acceptance_lengths)
        self.accepted += sum(generation.acceptance_lengths)
        if generation.first_token_at is not None:
            self.decode_tokens += len(generation.token_ids) - 1
            self.decode_s += generation.last_token_at - generation.first_token_at

    def line(self) -> str:
        acceptance = self.accepted / self.steps if self.steps else 0.0
        speed = f"{self.decode_tokens / self.decode_s:.1f} tokens/s" if self.decode_s > 0 else "- tokens/s"
        return (f"{self.answers} answers, {self.tokens} tokens in {self.steps} steps, acceptance {acceptance:.2f} "
                f"tokens/step, {speed}")


class Chat:
    """One conversation: its session handle (None until the first answer names it) and its statistics."""

    def __init__(self, client: Client, options: dict, system: str | None = None, session: str | None = None):
        """options: sampling options as `Client.chat` takes them; system: the first turn's system message."""
        self.client, self.options, self.system, self.session = client, options, system, session
        self.stats, self.last = Stats(), Stats()

    def say(self, text: str) -> None:
        """One turn: the user's text in, the answer streamed out."""
        messages = [{"role": "user", "content": text}]
        if self.session is None and self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        generation = self.client.chat(messages, session=self.session, keep_session=True, **self.options)
        try:
            stream(generation)
        except KeyboardInterrupt:
            generation.cancel()
            # NOTE: a first answer's handle comes with its summary: stopped before it, the session is unnamed here
            # (the gateway releases it once it idles out) and the next message starts a new conversation.
            print("\n[stopped]" if self.session else "\n[stopped; the next message starts a new conversation]")
            self._wait_until_idle()
        except GatewayError:
            if generation.text:
                print()  # the partial answer ends its line; the error follows
            raise
        else:
            print()
            self.session = generation.summary.session
        self.last = Stats()
        for stats in (self.stats, self.last):
            stats.add(generation)

    def fork(self) -> None:
        if self.session is None:
            print("[nothing to fork yet]")
            return
        parent, self.session = self.session, self.client.fork_session(self.session).session
        print(f"[on fork {self.session}; {parent} stays as it was: `ddtree chat --session {parent}` resumes it]")

    def reset(self) -> None:
        session, self.session, self.stats, self.last = self.session, None, Stats(), Stats()
        print("[new conversation]")
        if session is not None:
            self.client.release_session(session)

    def show_stats(self) -> None:
        held = f"{self.client.get_session(self.session).num_tokens} tokens" if self.session else "none yet"
        print(f"[session {self.session or '-'}: {held}]\n[all: {self.stats.line()}]\n[last: {self.last.line()}]")

    def _wait_until_idle(self) -> None:
        """A stopped answer lets go of its session within a step or so; the next turn must not find it busy."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while self.session is not None and time.monotonic() < deadline:
            if not self.client.get_session(self.session).generating:
                return
            time.sleep(0.05)

    def run(self) -> None:
        """Read lines until /quit or end of input. Ctrl-C at the prompt only clears the line; a failed turn or
        command is reported and the conversation goes on."""
        commands = {"/fork": self.fork, "/reset": self.reset, "/stats": self.show_stats, "/help": lambda: print(HELP)}
        while True:
            try:
                line = input("> ").strip()
            except KeyboardInterrupt:
                print("\n[/quit or Ctrl-D leaves]")
                continue
            except EOFError:
                print()
                break
            if line in ("/quit", "/exit"):
                break
            try:
                if line in commands:
                    commands[line]()
                elif line.startswith("/"):
                    print(f"[unknown command {line}: /help lists them]")
                elif line:
                    self.say(line)
            except GatewayError as error:
                print(f"[error: {error}]")
        if self.session is not None:
            print(f"[session {self.session} stays until it idles out: `ddtree chat --session {self.session}` "
                  "resumes it]")


def _chat(args: argparse.Namespace, client: Client) -> None:
    if sys.stdin.isatty():
        import readline  # noqa: F401 - line editing and history for input()

        # NOTE: Ctrl-C is how a chat stops an answer: started with SIGINT ignored (a script's background job inherits
        # that), it would raise nothing and the answer would run to its end
        signal.signal(signal.SIGINT, signal.default_int_handler)
    model = client.info().model.name or "the model"
    print(f"[chat with {model} at {args.gateway}; /help lists the commands]")
    Chat(client, sampling_options(args), args.system, args.session).run()


def add_chat_command(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser("chat", help="talk to the model on a running gateway (its chat template, one "
                                 "KV session per conversation)")
    chat.add_argument("--system", help="a system message to open the conversation with")
    chat.add_argument("--session", help="continue this session handle (a conversation left earlier)")
    sampling_args(chat)
    connection_args(chat)
    chat.set_defaults(run=guarded(_chat))
