"""The gateway's chat templates against transformers' `apply_chat_template`, on checkpoint directories written the
way Hugging Face writes them (tokenizer_config.json, chat_template.jinja). transformers is loaded only here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.chat_template import ChatTemplate
from gateway.errors import InvalidArgument
from modeling.tiny import CHAT_TEMPLATE, byte_level_tokenizer

# ChatML with a default system prompt, as Qwen2.5's checkpoints write it (tool-free part).
QWEN_STYLE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Headers, bos_token, trimmed content, a dated system header and a refusal, as Llama 3.x checkpoints write them.
LLAMA3_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}
{{- system_message + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Block tags on lines of their own (trim_blocks / lstrip_blocks do the work), a namespace, loop controls, the
# generation marker and tojson with non-ASCII and HTML characters.
BLOCKS_STYLE = """{% set ns = namespace(system='none') %}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% set ns.system = message.content %}
        {% continue %}
    {% endif %}
    [{{ message.role | upper }}] {% generation %}{{ message.content }}{% endgeneration %}

{% endfor %}
{{ {'system': ns.system, 'eos': eos_token, 'note': 'é <&>'} | tojson }}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""

TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|pad|>"}
SYSTEM = {"role": "system", "content": "  You are terse.  "}
TURNS = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": " Hi! How can I help? "},
         {"role": "user", "content": "Tell me about é and 日本 <b>."}]
CONVERSATIONS = {"with system": [SYSTEM, *TURNS], "without system": TURNS, "one user turn": TURNS[:1]}


def checkpoint(path: Path, template: str | list | None = None, jinja_file: str | None = None,
               tokens: dict | None = None) -> Path:
    """A tokenizer directory as Hugging Face saves one: tokenizer.json, tokenizer_config.json, maybe
    chat_template.jinja."""
    path.mkdir(parents=True, exist_ok=True)
    byte_level_tokenizer().save(str(path / "tokenizer.json"))
    config = {**(TOKENS if tokens is None else tokens), "model_max_length": 8192}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja_file is not None:
        (path / "chat_template.jinja").write_text(jinja_file)
    return path


def hf_render(path: Path, messages: list[dict], add_generation_prompt: bool) -> str:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", ["QWEN_STYLE", "LLAMA3_STYLE", "BLOCKS_STYLE", "CHAT_TEMPLATE"])
def test_rendering_equals_transformers(tmp_path, template: str, conversation: str,
                                       add_generation_prompt: bool) -> None:
    path = checkpoint(tmp_path, globals()[template])
    messages = CONVERSATIONS[conversation]
    ours = ChatTemplate.from_dir(path).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_render(path, messages, add_generation_prompt)


@pytest.mark.parametrize("layout", ["jinja file over tokenizer_config", "named templates", "token objects"])
def test_checkpoint_layouts_are_read_as_transformers_reads_them(tmp_path, layout: str) -> None:
    if layout == "jinja file over tokenizer_config":
        path = checkpoint(tmp_path, template=QWEN_STYLE, jinja_file=LLAMA3_STYLE)
    elif layout == "named templates":
        path = checkpoint(tmp_path, template=[{"name": "tool_use", "template": QWEN_STYLE},
                                              {"name": "default", "template": LLAMA3_STYLE}])
    else:  # special tokens saved as AddedToken objects
        path = checkpoint(tmp_path, template=LLAMA3_STYLE, tokens={
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False,
                          "normalized": False, "rstrip": False, "single_word": False, "special": True},
            "eos_token": "<|eot_id|>"})
    ours = ChatTemplate.from_dir(path).render(TURNS)
    assert ours == hf_render(path, TURNS, add_generation_prompt=True)
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system")


@pytest.mark.parametrize("reply_end", ["", "EOT"])
@pytest.mark.parametrize("template", [QWEN_STYLE, LLAMA3_STYLE, CHAT_TEMPLATE])
def test_a_continued_conversation_is_the_whole_conversation(tmp_path, template: str, reply_end: str) -> None:
    """A session holds the first turn's prompt and the reply as generated (ending with the stop token's text when
    one ended it); the continuation appended to it makes the text of the whole conversation."""
    chat = ChatTemplate.from_dir(checkpoint(tmp_path, template))
    first, reply, then = [SYSTEM, TURNS[0]], "Hi! How can I help?", [TURNS[2]]
    end_of_turn = {QWEN_STYLE: "<|im_end|>", LLAMA3_STYLE: "<|eot_id|>", CHAT_TEMPLATE: "<|im_end|>"}[template]
    stop_text = end_of_turn if reply_end else ""
    session = chat.render(first) + reply + stop_text
    whole = chat.render([*first, {"role": "assistant", "content": reply}, *then])
    assert session + chat.continuation(then, reply_end=stop_text) == whole


def test_the_template_refusing_messages_is_invalid_argument(tmp_path) -> None:
    chat = ChatTemplate.from_dir(checkpoint(tmp_path, LLAMA3_STYLE))
    with pytest.raises(InvalidArgument, match=r"^messages: .*Only user and assistant roles"):
        chat.render([SYSTEM, {"role": "tool", "content": "42"}])


@pytest.mark.parametrize("escape", ["{{ messages.__class__.__mro__ }}", "{% set x = messages.append(1) %}",
                                    "{{ ''.__class__.__subclasses__() }}"])
def test_templates_run_sandboxed(escape: str) -> None:
    with pytest.raises(InvalidArgument, match="^messages: "):
        ChatTemplate(escape).render(TURNS)


def test_a_template_that_does_not_compile_fails_at_load_and_none_is_none(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for message in messages %}")
    assert ChatTemplate.from_dir(checkpoint(tmp_path, template=None)) is None


def test_transformers_is_not_imported_by_the_gateway() -> None:
    import subprocess
    import sys

    code = "import sys, gateway.server; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
