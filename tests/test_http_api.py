"""The OpenAI-compatible HTTP API through the official `openai` client, against the real local stack on the tiny
model (gateway, verifier and an n-gram drafter as processes): the same greedy output as gRPC and as plain
decoding in this process, usage, stop strings, sessions, and the errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from ddtree.client import Client
from ddtree.local_stack import LocalStack, free_port
from ddtree.offline import generate_offline
from gateway.chat_template import ChatTemplate
from gateway.errors import QuotaExceeded
from gateway.http_api import _started
from gateway.openai_logprobs import TokenSpelling
from modeling.tiny import CHAT_TEMPLATE, EOS_TOKEN
from modeling.tokenizer import Tokenizer
from modeling.tree import DraftTree
from proto import common_pb2, gateway_pb2
from tests.engine_helpers import make_engine, run_to_end
from tests.stack_helpers import greedy_reference, verifier_info
from verifier_service.engine.logprobs import TokenLogprob
from verifier_service.engine.sampling import SamplingParams

MAX_NEW = 24
KEYS = ("k-alice", "k-bob")
MAX_SESSIONS = 4
MAX_CONTEXT = 4096
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What comes after 41?"}]
THEN = [{"role": "user", "content": "And after 42?"}]
PROMPT = "The cat sat on the mat. The cat"
LOGPROBS = 3
TEMPLATE = ChatTemplate(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def stack(tiny_target, tmp_path_factory):
    logs = tmp_path_factory.mktemp("http-logs")
    keys = logs / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    stack = LocalStack(str(tiny_target), "ngram", drafters=1, gateway_listen=f"127.0.0.1:{free_port()}",
                       log_dir=logs, verifier_args=("--page-size", "16", "--max-context", str(MAX_CONTEXT),
                                                    "--tree-budget", "8"),
                       gateway_args=("--api-keys-file", str(keys), "--max-sessions-per-key", str(MAX_SESSIONS)))
    with stack:
        yield stack


@pytest.fixture(scope="module")
def reference(tiny_target):
    return greedy_reference(tiny_target, MAX_NEW)


@pytest.fixture(scope="module")
def reference_logprobs(tiny_target):
    """Plain greedy decoding in this process with LOGPROBS alternatives: prompt ids -> tokens, their logprobs."""
    engine = make_engine(tiny_target, page_size=64)

    def generate(prompt: list[int]) -> tuple[list[int], list[TokenLogprob]]:
        session, _ = engine.create_session(prompt)
        engine.start_generation(session.session_id, SamplingParams(max_new_tokens=MAX_NEW, logprobs=LOGPROBS))
        tokens, results = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
        engine.release_session(session.session_id)
        return tokens, [lp for r in results for lp in r.logprobs]
    return generate


@pytest.fixture(scope="module")
def spelling(tiny_target) -> TokenSpelling:
    return TokenSpelling(Tokenizer.from_dir(tiny_target))


def model(stack: LocalStack) -> str:
    return Path(stack.target).name  # the verifier names the model by its checkpoint directory


def oai(stack: LocalStack, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key=key, max_retries=0, timeout=60)


def grpc_client(stack: LocalStack, key: str = KEYS[0]) -> Client:
    return Client(stack.addresses["gateway"], api_key=key, timeout=60)


def http(stack: LocalStack, method: str, path: str, key: str | None = KEYS[0], body: bytes | None = None
         ) -> tuple[int, Any]:
    """A raw request: (status, JSON body)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(stack.http_url.removesuffix("/v1") + path, data=body, method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def visible(generation) -> str:
    """A gRPC generation's text as OpenAI's content: without the text of the EOS that ended it."""
    stopped = generation.summary.stop_reason == common_pb2.STOP_REASON_STOP_TOKEN
    return generation.text.removesuffix(EOS_TOKEN) if stopped else generation.text


def finish_reason(generation) -> str:
    return "length" if generation.summary.stop_reason == common_pb2.STOP_REASON_LENGTH else "stop"


def test_chat_equals_grpc_and_plain_greedy_decoding_streaming_or_not(stack, reference) -> None:
    generation = grpc_client(stack).chat(CHAT, max_new_tokens=MAX_NEW)
    generation.result()
    prompt = reference.encode(TEMPLATE.render(CHAT))
    assert generation.token_ids == reference(prompt)

    client = oai(stack)
    reply = client.chat.completions.create(model=model(stack), messages=CHAT, max_tokens=MAX_NEW, temperature=0)
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == visible(generation)
    assert choice.finish_reason == finish_reason(generation) and reply.object == "chat.completion"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), len(generation.token_ids))
    assert reply.usage.total_tokens == len(prompt) + len(generation.token_ids)
    # NOTE: the full pages the gRPC call left, found in the verifier's prefix cache (16-token pages)
    assert reply.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert reply.model_extra["ddtree"]["session"] is None

    chunks = list(client.chat.completions.create(model=model(stack), messages=CHAT, max_completion_tokens=MAX_NEW,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 2) + [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_completions_equal_grpc_for_text_and_token_ids(stack, reference) -> None:
    generation = grpc_client(stack).generate(PROMPT, max_new_tokens=MAX_NEW)
    generation.result()
    assert generation.token_ids == reference(reference.encode(PROMPT))
    client = oai(stack)
    for prompt in (PROMPT, reference.encode(PROMPT), [PROMPT]):
        reply = client.completions.create(model=model(stack), prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        assert reply.choices[0].text == visible(generation) and reply.object == "text_completion"
        assert reply.choices[0].finish_reason == finish_reason(generation)
        assert reply.usage.prompt_tokens == len(reference.encode(PROMPT))
        assert reply.usage.completion_tokens == len(generation.token_ids)
    stream = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == visible(generation)
    assert chunks[-1].choices[0].finish_reason == finish_reason(generation) and chunks[-1].usage is None


def assert_top_alternatives(tops: list[list[tuple[int | str, float]]], expected: list[TokenLogprob],
                            spell=lambda token: token) -> None:
    """Each token's alternatives (token, logprob), best first, are the reference's."""
    assert [[token for token, _ in top] for top in tops] == [[spell(i) for i in lp.top_ids] for lp in expected]
    for top, lp in zip(tops, expected):
        assert [value for _, value in top] == pytest.approx(lp.top_logprobs, abs=1e-5)


def test_completion_logprobs_equal_grpc_and_plain_decoding_streaming_or_not(stack, reference, reference_logprobs,
                                                                            spelling) -> None:
    tokens, expected = reference_logprobs(reference.encode(PROMPT))
    generation = grpc_client(stack).generate(PROMPT, max_new_tokens=MAX_NEW, logprobs=LOGPROBS)
    generation.result()
    assert generation.token_ids == tokens and len(generation.logprobs) == len(tokens)
    assert [lp.logprob for lp in generation.logprobs] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    assert_top_alternatives([list(zip(lp.top_token_ids, lp.top_logprobs)) for lp in generation.logprobs], expected)
    assert grpc_client(stack).generate(PROMPT, max_new_tokens=4).logprobs == []  # none unless asked

    client = oai(stack)
    reply = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                      logprobs=LOGPROBS)
    got = reply.choices[0].logprobs
    assert got.tokens == [spelling.text(t) for t in tokens]
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    for top, lp in zip(got.top_logprobs, expected):
        # NOTE: greedy: the chosen token leads its alternatives, so a dict holds the LOGPROBS best alone, the better
        # of two spelled alike (the tiny model's ids past the tokenizer's vocabulary spell "")
        spelled = [(spelling.text(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
        assert top == pytest.approx(dict(reversed(spelled)), abs=1e-5)
    assert got.text_offset == list(itertools.accumulate(map(len, got.tokens), initial=0))[:-1]
    assert client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=4).choices[0].logprobs is None

    chunks = list(client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                            logprobs=LOGPROBS, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks[:-1]]
    assert [t for s in streamed for t in s.tokens] == got.tokens and chunks[-1].choices[0].logprobs is None
    assert [o for s in streamed for o in s.text_offset] == got.text_offset
    # NOTE: another call runs in other batches (the n-gram drafter's trees differ): equal up to the sums' order
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(got.token_logprobs, abs=1e-5)
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text


def test_chat_logprobs_equal_plain_decoding_streaming_or_not(stack, reference, reference_logprobs,
                                                            spelling) -> None:
    tokens, expected = reference_logprobs(reference.encode(TEMPLATE.render(CHAT)))
    client = oai(stack)
    reply = client.chat.completions.create(model=model(stack), messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [spelling.text(t) for t in tokens]
    assert [c.bytes for c in content] == [list(spelling.bytes(t)) for t in tokens]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    two_best = [TokenLogprob(lp.logprob, lp.top_ids[:2], lp.top_logprobs[:2]) for lp in expected]
    assert_top_alternatives([[(t.token, t.logprob) for t in c.top_logprobs] for c in content], two_best, spelling.text)
    assert all(t.bytes == list(spelling.bytes(i)) for c, lp in zip(content, two_best)
               for t, i in zip(c.top_logprobs, lp.top_ids))

    chunks = list(client.chat.completions.create(model=model(stack), messages=CHAT, max_tokens=MAX_NEW,
                                                 temperature=0, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(c.token, c.bytes) for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs: no alternatives


def test_a_long_prompts_prefill_progress_stays_out_of_the_http_api(stack, reference) -> None:
    """Over gRPC a prompt longer than one prefill chunk (256 tokens) sends its prefill's progress before the first
    chunk; over HTTP the same generation is OpenAI's chunks alone, with the same text."""
    prompt = [1 + i % 250 for i in range(700)]
    generation = grpc_client(stack).generate(token_ids=prompt, max_new_tokens=MAX_NEW)
    events = list(generation.events())
    assert any(isinstance(event, common_pb2.PrefillProgress) for event in events)
    assert generation.token_ids == reference(prompt)
    client = oai(stack)
    reply = client.completions.create(model=model(stack), prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    assert reply.choices[0].text == visible(generation) and reply.usage.prompt_tokens == len(prompt)
    chunks = list(client.completions.create(model=model(stack), prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == visible(generation)
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks)


def test_stop_strings_cut_the_text(stack, spelling) -> None:
    generation = grpc_client(stack).generate(PROMPT, max_new_tokens=40)
    generation.result()
    text = visible(generation)
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].isascii()
                and text[i:i + 2].isprintable())
    expected = text[:text.index(stop)]
    client = oai(stack)
    for stops in (stop, [stop, "never in the output"]):
        reply = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=40, temperature=0, stop=stops)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (expected, "stop")
    reply = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                      logprobs=0)
    # NOTE: every generated token has its logprob, the one that completed the stop string too
    tokens, decode = reply.choices[0].logprobs.tokens, Tokenizer.from_dir(stack.target).decode
    ids = generation.token_ids[:reply.usage.completion_tokens]
    assert tokens == [spelling.text(t) for t in ids] and stop in decode(ids) and stop not in decode(ids[:-1])
    chunks = list(client.chat.completions.create(model=model(stack), messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=40, temperature=0, stop=stop, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert stop not in text and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sessions_keep_continue_and_fork_over_http(stack, reference) -> None:
    """Turn 2 on a session is the turn-1 prompt, its reply as generated and the continuation of the chat, decoded
    plainly; a fork gets the same and leaves the session as it was."""
    client, grpc = oai(stack), grpc_client(stack)
    first = client.chat.completions.create(model=model(stack), messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                           extra_body={"ddtree": {"keep_session": True}})
    handle = first.model_extra["ddtree"]["session"]
    reply = grpc.chat(CHAT, max_new_tokens=MAX_NEW, keep_session=True)  # the same turn over gRPC: its token ids
    reply.result()
    held = reference.encode(TEMPLATE.render(CHAT)) + reply.token_ids
    assert grpc.get_session(handle).num_tokens == len(held)
    stop_text = EOS_TOKEN if reply.summary.stop_reason == common_pb2.STOP_REASON_STOP_TOKEN else ""
    second = grpc.chat(THEN, session=reply.summary.session, max_new_tokens=MAX_NEW)
    second.result()
    appended = reference.encode(TEMPLATE.continuation(THEN, stop_text))
    assert second.token_ids == reference(held + appended)

    fork = client.chat.completions.create(model=model(stack), messages=THEN, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ddtree": {"session": handle, "fork": True}})
    assert fork.model_extra["ddtree"]["session"] is None  # not kept: released after the reply
    assert grpc.get_session(handle).num_tokens == len(held)  # the parent is as it was
    kept_fork = client.chat.completions.create(
        model=model(stack), messages=THEN, max_tokens=MAX_NEW, temperature=0,
        extra_body={"ddtree": {"session": handle, "fork": True, "keep_session": True}})
    continued = client.chat.completions.create(model=model(stack), messages=THEN, max_tokens=MAX_NEW, temperature=0,
                                               extra_body={"ddtree": {"session": handle}})
    for turn in (fork, kept_fork, continued):
        assert turn.choices[0].message.content == visible(second)
        assert turn.usage.prompt_tokens == len(held + appended)
        assert turn.usage.prompt_tokens_details.cached_tokens == len(held)
    assert continued.model_extra["ddtree"]["session"] == handle
    forked = kept_fork.model_extra["ddtree"]["session"]
    assert forked not in (None, handle) and grpc.get_session(forked).num_tokens == grpc.get_session(handle).num_tokens

    for session in (handle, forked, reply.summary.session):
        assert http(stack, "DELETE", f"/v1/sessions/{session}") == (
            200, {"id": session, "object": "session", "deleted": True})
    status, body = http(stack, "DELETE", f"/v1/sessions/{handle}")
    assert status == 404 and body["error"]["code"] == "not_found"
    assert grpc.list_sessions() == []


def api_error(call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value


@pytest.mark.parametrize("request_fields, status, param", [
    ({"temperature": -1.0}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"n": 17}, 400, "n"),
    ({"n": 2.5}, 400, "n"),
    ({"n": "2"}, 400, "n"),
    ({"n": 2, "ddtree": {"keep_session": True}}, 400, "n"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"logprobs": 2}, 400, "logprobs"),
    ({"stop": [""]}, 400, "stop"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"ddtree": {"session": "0" * 48}}, 404, "ddtree.session"),
    ({"ddtree": {"fork": True}}, 400, "ddtree.fork"),
    ({"messages": [{"role": "user", "content": "x" * (MAX_CONTEXT + 10)}]}, 413, "messages"),
])
def test_bad_chat_requests_get_their_status_and_name_the_field(stack, request_fields: dict, status: int,
                                                               param: str) -> None:
    fields = {"model": model(stack), "messages": CHAT, "max_tokens": 4, **request_fields}
    extension = {"ddtree": fields.pop("ddtree")} if "ddtree" in fields else None
    error = api_error(lambda: oai(stack).chat.completions.create(**fields, extra_body=extension))
    assert error.status_code == status and error.body["param"] == param, error.body
    assert error.body["message"].startswith(f"{param}: ") and error.body["type"]


@pytest.mark.parametrize("fields, param", [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
                                           ({"logprobs": True}, "logprobs"), ({"logprobs": 2**40}, "logprobs"),
                                           ({"top_logprobs": 2}, "top_logprobs")])
def test_bad_completion_logprobs_name_the_field(stack, fields: dict, param: str) -> None:
    error = api_error(lambda: oai(stack).completions.create(model=model(stack), prompt=PROMPT, max_tokens=4,
                                                            extra_body=fields))
    assert error.status_code == 400 and error.body["param"] == param, error.body


def test_penalties_and_logit_bias_over_grpc_and_http_equal_plain_decoding(stack, tiny_target, reference) -> None:
    """Through the gateway's gRPC API and OpenAI's fields (repetition_penalty as vLLM takes it: at the body's top
    level), under the stack's speculation: the tokens of plain decoding with the same adjustments."""
    prompt = reference.encode(PROMPT)
    params = SamplingParams(max_new_tokens=MAX_NEW, repetition_penalty=1.5, presence_penalty=0.8,
                            frequency_penalty=0.6, logit_bias=((42, 3.0),))
    expected = generate_offline(make_engine(tiny_target, page_size=64), None, prompt, params).token_ids
    assert expected != reference(prompt)
    generation = grpc_client(stack).generate(PROMPT, max_new_tokens=MAX_NEW, repetition_penalty=1.5,
                                             presence_penalty=0.8, frequency_penalty=0.6, logit_bias={42: 3.0})
    generation.result()
    assert generation.token_ids == expected
    client = oai(stack)
    reply = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                      presence_penalty=0.8, frequency_penalty=0.6, logit_bias={"42": 3.0},
                                      extra_body={"repetition_penalty": 1.5})
    assert reply.choices[0].text == visible(generation) and reply.usage.completion_tokens == len(expected)
    (x,) = reference.encode("x")
    chat = client.chat.completions.create(model=model(stack), messages=CHAT, max_tokens=5, temperature=0,
                                          logit_bias={str(x): 100})
    assert chat.choices[0].message.content == "xxxxx"


@pytest.mark.parametrize("fields, param, message", [
    ({"repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
    ({"repetition_penalty": "1.2"}, "repetition_penalty", "must be a number"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2.5 is outside [-2.0, 2.0]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-3.0 is outside [-2.0, 2.0]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "token 999999 is outside the vocabulary (0..319)"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "token 5's bias 101.0 is outside [-100, 100]"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "keys are token ids"),
    ({"logit_bias": {"5": "1"}}, "logit_bias", "the bias of token 5 must be a number"),
    ({"logit_bias": [5]}, "logit_bias", "must be a JSON object"),
    ({"logit_bias": dict.fromkeys(map(str, range(301)), 1)}, "logit_bias", "301 tokens, at most 300"),
])
def test_bad_penalties_and_logit_bias_are_400s_naming_the_field(stack, fields: dict, param: str,
                                                                message: str) -> None:
    body = json.dumps({"model": model(stack), "messages": CHAT, "max_tokens": 4, **fields}).encode()
    status, reply = http(stack, "POST", "/v1/chat/completions", body=body)
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(f"{param}: {message}"), reply


@pytest.mark.parametrize("prompt, status", [("x" * (MAX_CONTEXT + 10), 413), ([7, -1], 400), (["a", "b"], 400),
                                            ("", 400)])
def test_bad_completion_prompts_name_the_field(stack, prompt, status: int) -> None:
    error = api_error(lambda: oai(stack).completions.create(model=model(stack), prompt=prompt, max_tokens=4))
    assert error.status_code == status and error.body["param"] == "prompt", error.body


def test_keys_sessions_of_other_keys_and_quotas(stack) -> None:
    error = api_error(lambda: oai(stack, key="k-mallory").models.list())
    assert error.status_code == 401 and error.body["type"] == "authentication_error"
    status, body = http(stack, "POST", "/v1/completions", key=None, body=b'{"prompt": "hi"}')
    assert status == 401 and "authorization" in body["error"]["message"]

    alice, bob = oai(stack), oai(stack, key=KEYS[1])
    kept = [bob.completions.create(model=model(stack), prompt="hold", max_tokens=2, temperature=0,
                                   extra_body={"ddtree": {"keep_session": True}}).model_extra["ddtree"]["session"]
            for _ in range(MAX_SESSIONS)]
    error = api_error(lambda: alice.completions.create(model=model(stack), prompt=" more", max_tokens=2,
                                                       extra_body={"ddtree": {"session": kept[0]}}))
    assert error.status_code == 403 and error.body["param"] == "ddtree.session"
    error = api_error(lambda: bob.completions.create(model=model(stack), prompt="one too many", max_tokens=2))
    assert error.status_code == 429 and error.body["type"] == "rate_limit_error" and error.body["param"] is None
    for session in kept:
        assert http(stack, "DELETE", f"/v1/sessions/{session}", key=KEYS[1])[0] == 200


def test_malformed_bodies_unknown_routes_models_and_health(stack) -> None:
    for malformed in (b"{not json", b"[1, 2]", b"\xff"):
        status, body = http(stack, "POST", "/v1/chat/completions", body=malformed)
        assert status == 400 and body["error"]["message"].startswith("request body: "), body
    status, body = http(stack, "GET", "/v1/engines")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert http(stack, "GET", "/health", key=None) == (200, {"status": "ok"})
    (listed,) = oai(stack).models.list().data
    assert listed.id == model(stack) and listed.model_extra["max_model_len"] == MAX_CONTEXT


@pytest.mark.parametrize("keep", [False, True])
def test_a_client_that_leaves_mid_stream_stops_the_generation(stack, keep: bool) -> None:
    """Closing the stream cancels the request's handler, and so the generation: a one-shot session is released,
    a kept one stays with what was generated until then."""
    stream = oai(stack).completions.create(model=model(stack), prompt=PROMPT, max_tokens=3000, temperature=0,
                                           stream=True, extra_body={"ddtree": {"keep_session": keep}})
    next(iter(stream))
    stream.close()
    grpc = grpc_client(stack)

    def settled() -> bool:  # NOTE: the verifier ends the cancelled generation (and releases) after the gateway
        sessions = grpc.list_sessions()
        held = verifier_info(stack).active_sessions
        return not any(s.generating for s in sessions) and len(sessions) == keep and held == keep

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not settled():
        time.sleep(0.05)
    assert settled()
    if keep:
        (session,) = grpc.list_sessions()
        assert session.num_tokens < 3000
        grpc.release_session(session.session)


def test_prefill_progress_is_no_output_so_a_failure_after_it_is_the_replys_own_status() -> None:
    """A prompt that reports its prefill (at 0 tokens while it waits for KV pages) and then fails before any token:
    the failure comes out of `_started`, before the reply's status line is written (a 429, not an error event)."""
    async def replies():
        yield 0, gateway_pb2.GenerateReply(prefill=common_pb2.PrefillProgress(prefilled_tokens=0, total_tokens=30))
        raise QuotaExceeded("KV cache full: waited 60 s")

    async def outputs():
        yield 0, gateway_pb2.GenerateReply(prefill=common_pb2.PrefillProgress(prefilled_tokens=0, total_tokens=30))
        yield 1, gateway_pb2.GenerateReply(chunk=gateway_pb2.GenerateChunk(token_ids=[5]))
        yield 0, gateway_pb2.GenerateReply(prefill=common_pb2.PrefillProgress(prefilled_tokens=10, total_tokens=30))

    with pytest.raises(QuotaExceeded):
        asyncio.run(_started(replies()))

    async def read() -> list:
        return [(index, message) async for index, message in await _started(outputs())]

    assert [(index, message.WhichOneof("kind")) for index, message in asyncio.run(read())] == [(1, "chunk")]
