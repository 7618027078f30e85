"""A checkpoint's Jinja chat template, rendered as Hugging Face's `apply_chat_template` renders it.

The template is the checkpoint's own code: `chat_template.jinja` next to `tokenizer.json`, else the
`chat_template` of `tokenizer_config.json`. It runs in jinja2's immutable sandbox with the environment that
templates are written against: trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` marker, a
`tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, and the tokenizer's special tokens
(`bos_token`, `eos_token`, ...) as variables. No transformers: the gateway does not depend on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import InvalidArgument

Message = Mapping[str, str]  # {"role": ..., "content": ...}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Stands for a session's last reply when its continuation is rendered (see `ChatTemplate.continuation`).
_REPLY = "ddtree-session-reply-7c1e"


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it is its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: jinja2's own tojson escapes <, >, & and ' for HTML and sorts keys; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        """`source` is the Jinja text; a syntax error raises ValueError here, not at the first request."""
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not compile: {error} (line {error.lineno})") from None
        self._variables = dict(special_tokens or {})

    @staticmethod
    def from_dir(path: str | Path) -> ChatTemplate | None:
        """The checkpoint's template and special tokens; None when it has no template."""
        path = Path(path)
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        jinja_file = path / "chat_template.jinja"
        source = jinja_file.read_text() if jinja_file.is_file() else _default_template(config.get("chat_template"))
        if source is None:
            return None
        tokens = {name: _token_text(config[name]) for name in SPECIAL_TOKENS if config.get(name) is not None}
        return ChatTemplate(source, tokens)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text; a template that refuses it (raise_exception, a role
        it does not know) is InvalidArgument naming `messages`."""
        try:
            return self._template.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self._variables)
        except (jinja2.TemplateError, TypeError) as error:
            raise InvalidArgument(f"messages: the model's chat template refused them: {error}") from None

    def continuation(self, messages: Sequence[Message], reply_end: str = "") -> str:
        """The text that follows a session's last reply: `messages` rendered as the turns after an assistant's
        reply, then the generation prompt. The reply's own end-of-turn text is the template's (what closes an
        assistant turn), less `reply_end`, the text of the stop token the reply already ended with.

        NOTE: rendered behind a stand-in conversation (a user turn and a marked assistant reply) and cut after
        the mark, so the template sees the turns where they belong: its default system prompt, role checks and
        separators come out as they would in the whole conversation.
        """
        stand_in = [{"role": "user", "content": "..."}, {"role": "assistant", "content": _REPLY}]
        text = self.render([*stand_in, *messages], add_generation_prompt=True)
        at = text.find(_REPLY)
        if at < 0:
            raise InvalidArgument("messages: the model's chat template drops assistant replies from the "
                                  "conversation, so a session cannot be continued with messages")
        return text[at + len(_REPLY):].removeprefix(reply_end)


def _default_template(value: str | list | None) -> str | None:
    """tokenizer_config.json's `chat_template`: one template, or named ones of which "default" is used."""
    if isinstance(value, list):
        return next((t["template"] for t in value if t.get("name") == "default"), None)
    return value


def _token_text(value: str | Mapping[str, Any]) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken object holding it."""
    return value["content"] if isinstance(value, Mapping) else value
