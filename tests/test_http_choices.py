"""`n` choices on the OpenAI-compatible API against the real local stack on the tiny model (gateway, verifier and,
for the greedy tests, an n-gram drafter, as processes): n greedy choices are n copies of plain decoding's reply,
n sampled ones with a seed are the one-choice replies of the derived seeds, streams interleave them, usage counts
every choice, and no session or KV page outlives a request, a cancelled one included."""

from __future__ import annotations

import json
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import openai
import pytest

from ddtree.client import Client
from ddtree.local_stack import LocalStack, free_port
from gateway.chat_template import ChatTemplate
from modeling.tiny import CHAT_TEMPLATE, EOS_TOKEN
from tests.stack_helpers import greedy_reference, verifier_info

MAX_NEW = 20
KEY = "k-alice"
MAX_SESSIONS = 4  # a request of n choices holds n + 1 sessions while it runs: n = 3 fits, n = 4 does not
PROMPT = "The cat sat on the mat. The cat"
CHAT = [{"role": "user", "content": "What comes after 41?"}]
SEED = 2**64 - 2  # choices 0, 1, 2 sample with seeds 2**64 - 2, 2**64 - 1 and 0


def start_stack(target, logs: Path, drafter: str) -> LocalStack:
    keys = logs / "keys.txt"
    keys.write_text(KEY + "\n")
    return LocalStack(str(target), drafter, gateway_listen=f"127.0.0.1:{free_port()}", log_dir=logs,
                      verifier_args=("--page-size", "16", "--max-context", "2048", "--tree-budget", "8"),
                      gateway_args=("--api-keys-file", str(keys), "--max-sessions-per-key", str(MAX_SESSIONS)))


@pytest.fixture(scope="module")
def stack(tiny_target, tmp_path_factory):
    """With an n-gram drafter: the greedy choices go through speculation."""
    with start_stack(tiny_target, tmp_path_factory.mktemp("choices-logs"), "ngram") as stack:
        yield stack


@pytest.fixture(scope="module")
def plain_stack(tiny_target, tmp_path_factory):
    """Without a drafter: a sampled generation draws one number a step, so a seed replays it whatever the batch
    (with drafts it draws one a tree row, and the trees depend on what else runs)."""
    with start_stack(tiny_target, tmp_path_factory.mktemp("choices-plain-logs"), "none") as stack:
        yield stack


@pytest.fixture(scope="module")
def reference(tiny_target):
    return greedy_reference(tiny_target, MAX_NEW)


def oai(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0, timeout=60)


def grpc_client(stack: LocalStack) -> Client:
    return Client(stack.addresses["gateway"], api_key=KEY, timeout=30)


def model(stack: LocalStack) -> str:
    return Path(stack.target).name


def events(stack: LocalStack, route: str, body: dict) -> list[Any]:
    """A streamed request's server-sent events, raw: each JSON payload, or the string "[DONE]"."""
    request = urllib.request.Request(f"{stack.http_url}/{route}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().split("\n\n")
    payloads = [line.removeprefix("data: ") for line in lines if line]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def assert_no_session_left(stack: LocalStack, timeout_s: float = 10.0) -> None:
    """Neither the gateway nor the verifier holds a session, and every KV page is free."""
    grpc = grpc_client(stack)

    def clean() -> bool:
        info = verifier_info(stack)
        return not grpc.list_sessions() and info.active_sessions == 0 and info.free_pages == info.kv_capacity_pages
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not clean():
        time.sleep(0.05)
    assert clean(), (grpc.list_sessions(), verifier_info(stack))


def greedy_text(generation, expected_ids: list[int]) -> str:
    """A gRPC generation's text as OpenAI's content (without the EOS that ended it), once its tokens are checked
    against plain decoding's."""
    generation.result()
    assert generation.token_ids == expected_ids
    return generation.text.removesuffix(EOS_TOKEN)


def test_greedy_choices_are_n_copies_of_plain_decoding(stack, reference) -> None:
    prompt = reference.encode(PROMPT)
    expected = greedy_text(grpc_client(stack).generate(PROMPT, max_new_tokens=MAX_NEW), reference(prompt))
    client = oai(stack)
    one = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
    three = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, n=3)
    assert one.choices[0].text == expected
    assert [(c.index, c.text, c.finish_reason) for c in three.choices] == [
        (i, expected, one.choices[0].finish_reason) for i in range(3)]
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == (len(prompt), 3 * one.usage.completion_tokens)
    assert three.usage.total_tokens == len(prompt) + 3 * one.usage.completion_tokens
    # NOTE: prefilled by this request, once, after the full pages the calls before left in the prefix cache
    assert three.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    extension = three.model_extra["ddtree"]
    assert extension["session"] is None and extension["steps"] >= 3  # every choice's steps

    chat_prompt = reference.encode(ChatTemplate(CHAT_TEMPLATE).render(CHAT))
    chat_expected = greedy_text(grpc_client(stack).chat(CHAT, max_new_tokens=MAX_NEW), reference(chat_prompt))
    chat = client.chat.completions.create(model=model(stack), messages=CHAT, max_tokens=MAX_NEW, temperature=0, n=2,
                                          logprobs=True, top_logprobs=2)
    assert [c.message.content for c in chat.choices] == [chat_expected] * 2
    first, second = ([(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in c.logprobs.content]
                     for c in chat.choices)
    assert [t for t, _, _ in first] == [t for t, _, _ in second] and len(first) == chat.usage.completion_tokens // 2
    assert [top for _, _, top in first] == [top for _, _, top in second]
    assert [lp for _, lp, _ in first] == pytest.approx([lp for _, lp, _ in second], abs=1e-5)
    assert_no_session_left(stack)


def sampled(stack: LocalStack, n: int, seed: int, **fields: Any) -> Any:
    return oai(stack).completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=1.5,
                                         seed=seed, n=n, **fields)


def test_sampled_choices_with_a_seed_are_the_one_choice_replies_of_the_derived_seeds(plain_stack) -> None:
    """Choice i samples with seed + i (mod 2**64); the forks do not disturb one another; the reply replays."""
    three = sampled(plain_stack, 3, SEED)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and len(set(texts)) == 3
    singles = [sampled(plain_stack, 1, seed) for seed in (SEED, SEED + 1, 0)]
    assert texts == [s.choices[0].text for s in singles]
    assert [c.finish_reason for c in three.choices] == [s.choices[0].finish_reason for s in singles]
    assert three.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert [c.text for c in sampled(plain_stack, 3, SEED).choices] == texts
    assert_no_session_left(plain_stack)


def test_streamed_choices_reassemble_to_the_reply(plain_stack) -> None:
    """Chunks of the choices interleaved, each naming its index; one finish chunk a choice; the "ddtree" object on
    the last, then the usage once, then one [DONE]."""
    body = {"model": model(plain_stack), "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 1.5, "seed": 11,
            "n": 3, "logprobs": 1}
    whole = sampled(plain_stack, 3, 11, logprobs=1)
    streamed = events(plain_stack, "completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert streamed[-1] == "[DONE]" and streamed.count("[DONE]") == 1
    *chunks, usage = streamed[:-1]
    assert usage["choices"] == [] and usage["usage"] == whole.usage.model_dump(exclude_none=True)
    texts, tokens, finishes = defaultdict(str), defaultdict(list), defaultdict(list)
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["logprobs"]:
            tokens[choice["index"]] += zip(choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"])
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    for choice in whole.choices:
        assert texts[choice.index] == choice.text and finishes[choice.index] == [choice.finish_reason]
        assert tokens[choice.index] == list(zip(choice.logprobs.tokens, choice.logprobs.text_offset))
    # NOTE: the steps are not compared: how many tokens a step message carries depends on the batch's bursts
    (extension,) = [c["ddtree"] for c in chunks if "ddtree" in c]
    assert extension == chunks[-1]["ddtree"] and extension["session"] is None and extension["steps"] >= 3
    assert len({c["id"] for c in chunks}) == 1

    chat = events(plain_stack, "chat/completions", {"model": model(plain_stack), "messages": CHAT, "n": 2,
                                                    "max_tokens": 4, "stream": True})
    assert [c["choices"][0]["delta"] for c in chat[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["choices"][0]["index"] for c in chat[:2]] == [0, 1]
    assert sorted(c["choices"][0]["index"] for c in chat[:-1] if c["choices"][0]["finish_reason"]) == [0, 1]
    assert_no_session_left(plain_stack)


def test_choices_on_a_session_fork_it_and_leave_it_as_it_was(stack) -> None:
    client, grpc = oai(stack), grpc_client(stack)
    first = client.completions.create(model=model(stack), prompt=PROMPT, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ddtree": {"keep_session": True}})
    handle = first.model_extra["ddtree"]["session"]
    held = grpc.get_session(handle).num_tokens
    fork = client.completions.create(model=model(stack), prompt=" and then", max_tokens=MAX_NEW, temperature=0,
                                     extra_body={"ddtree": {"session": handle, "fork": True}})
    for extension in ({"session": handle}, {"session": handle, "fork": True}):
        two = client.completions.create(model=model(stack), prompt=" and then", max_tokens=MAX_NEW, temperature=0,
                                        n=2, extra_body={"ddtree": extension})
        assert [c.text for c in two.choices] == [fork.choices[0].text] * 2
        assert two.usage.prompt_tokens == fork.usage.prompt_tokens
        assert two.usage.prompt_tokens_details.cached_tokens == held
        assert two.usage.completion_tokens == 2 * fork.usage.completion_tokens
        assert two.model_extra["ddtree"]["session"] is None
        assert grpc.get_session(handle).num_tokens == held and len(grpc.list_sessions()) == 1
    grpc.release_session(handle)
    assert_no_session_left(stack)


def test_choices_count_against_the_session_quota(stack) -> None:
    error = pytest.raises(openai.RateLimitError, oai(stack).completions.create, model=model(stack), prompt=PROMPT,
                          max_tokens=4, n=MAX_SESSIONS)
    assert error.value.body["message"].startswith("session: ") and "needs 5 more" in error.value.body["message"]
    assert_no_session_left(stack)


@pytest.mark.parametrize("n", [0, 17, 1.5, True])
def test_n_out_of_range_or_not_an_integer_is_400_naming_n(stack, n) -> None:
    error = pytest.raises(openai.BadRequestError, oai(stack).completions.create, model=model(stack), prompt=PROMPT,
                          max_tokens=4, n=n)
    assert error.value.body["param"] == "n" and error.value.body["message"].startswith("n: ")


def test_best_of_stays_1_only(stack) -> None:
    error = pytest.raises(openai.BadRequestError, oai(stack).completions.create, model=model(stack), prompt=PROMPT,
                          max_tokens=4, n=2, best_of=2)
    assert error.value.body["param"] == "best_of"


def test_a_client_that_leaves_a_stream_of_choices_releases_every_fork(stack) -> None:
    stream = oai(stack).completions.create(model=model(stack), prompt=PROMPT, max_tokens=2000, temperature=0, n=3,
                                           stream=True)
    next(iter(stream))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and verifier_info(stack).active_sessions < 4:
        time.sleep(0.02)
    assert verifier_info(stack).active_sessions == 4  # the prompt's session and a fork a choice, all at once
    stream.close()
    assert_no_session_left(stack)
