"""A prompt's own log-probabilities over the real local stack on the tiny model (gateway, verifier and an n-gram
drafter as processes): OpenAI's `echo` on /v1/completions (the prompt's text and logprobs before the reply's, also
with max_tokens 0 and n choices, streamed or not), vLLM's `prompt_logprobs`, and gRPC's `prompt_logprobs`, each
equal to transformers' fp32 log_softmax at every prompt position; and the 400s naming the field."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import grpc
import openai
import pytest
import torch

from ddtree.client import Client
from ddtree.local_stack import LocalStack, free_port
from gateway.openai_logprobs import TokenSpelling
from modeling.tokenizer import Tokenizer
from tests.stack_helpers import verifier_info

KEY = "k-alice"
PROMPT = "The cat sat on the mat. The cat"
LONG = [1 + (i * 37) % 250 for i in range(300)]  # NOTE: 299 rows: two prefill chunks (256), seven logit slices (48)
MAX_NEW = 6


@pytest.fixture(scope="module")
def stack(tiny_target, tmp_path_factory):
    logs = tmp_path_factory.mktemp("echo-logs")
    (logs / "keys.txt").write_text(KEY + "\n")
    stack = LocalStack(str(tiny_target), "ngram", gateway_listen=f"127.0.0.1:{free_port()}", log_dir=logs,
                       verifier_args=("--page-size", "16", "--max-context", "2048", "--tree-budget", "8",
                                      "--prompt-logprob-rows", "48"),
                       gateway_args=("--api-keys-file", str(logs / "keys.txt")))
    with stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer(tiny_target) -> Tokenizer:
    return Tokenizer.from_dir(tiny_target)


@pytest.fixture(scope="module")
def spelling(tokenizer) -> TokenSpelling:
    return TokenSpelling(tokenizer)


def oai(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key=KEY, max_retries=0, timeout=60)


def complete(stack: LocalStack, prompt, **fields):
    extra = {k: fields.pop(k) for k in ("prompt_logprobs", "ddtree") if k in fields}
    return oai(stack).completions.create(model=Path(stack.target).name, prompt=prompt, temperature=0,
                                         extra_body=extra or None, **fields)


def expected_rows(hf_logprobs, ids: list[int], scored: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For the tokens at positions `scored` of `ids`: their reference logprobs [S] and their rows [S, V]."""
    rows = hf_logprobs(ids)[[p - 1 for p in scored]]
    return rows.gather(-1, torch.tensor([ids[p] for p in scored])[:, None])[:, 0], rows


def assert_echoed(logprobs, prompt: list[int], generated, spelling: TokenSpelling, hf_logprobs, width: int,
                  first_scored: bool = False, context: list[int] = ()) -> None:
    """Completions' `logprobs` of an echoed `prompt` (after `context`, a session's tokens) then the `generated`
    reply's: the prompt's entries against transformers, null for a new prompt's first token, offsets running on."""
    n = len(prompt)
    assert logprobs.tokens == [spelling.text(t) for t in prompt] + generated.tokens
    assert logprobs.text_offset == list(itertools.accumulate(map(len, logprobs.tokens), initial=0))[:-1]
    assert logprobs.token_logprobs[n:] == pytest.approx(generated.token_logprobs, abs=1e-5)
    skip = 0 if first_scored else 1
    if not first_scored:
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    ids = list(context) + prompt
    values, rows = expected_rows(hf_logprobs, ids, list(range(len(context) + skip, len(ids))))
    assert logprobs.token_logprobs[skip:n] == pytest.approx(values.tolist(), abs=1e-4)
    top = rows.topk(width, dim=-1)
    for got, ids_, vals, token in zip(logprobs.top_logprobs[skip:n], top.indices.tolist(), top.values.tolist(),
                                      prompt[skip:]):
        assert set(got) <= {spelling.text(i) for i in ids_ + [token]} and len(got) <= width + 1
        assert max(got.values()) == pytest.approx(vals[0] if width else got[spelling.text(token)], abs=1e-4)


def test_echo_with_logprobs_over_a_long_prompt_equals_transformers(stack, spelling, hf_logprobs, tokenizer) -> None:
    plain = complete(stack, LONG, max_tokens=MAX_NEW, logprobs=2).choices[0]
    echoed = complete(stack, LONG, max_tokens=MAX_NEW, logprobs=2, echo=True)
    (choice,) = echoed.choices
    assert choice.text == tokenizer.decode(LONG) + plain.text
    assert_echoed(choice.logprobs, LONG, plain.logprobs, spelling, hf_logprobs, 2)
    assert echoed.usage.prompt_tokens == len(LONG) and echoed.usage.completion_tokens == len(plain.logprobs.tokens)


def test_echo_of_a_text_prompt_streamed_or_not_and_without_logprobs(stack, spelling, hf_logprobs, tokenizer) -> None:
    plain = complete(stack, PROMPT, max_tokens=MAX_NEW, logprobs=1).choices[0]
    whole = complete(stack, PROMPT, max_tokens=MAX_NEW, logprobs=1, echo=True).choices[0]
    assert whole.text == PROMPT + plain.text
    assert_echoed(whole.logprobs, tokenizer.encode(PROMPT), plain.logprobs, spelling, hf_logprobs, 1)
    chunks = list(complete(stack, PROMPT, max_tokens=MAX_NEW, logprobs=1, echo=True, stream=True))
    assert chunks[0].choices[0].text == PROMPT  # NOTE: the prompt first, as its own chunk (vLLM's)
    assert chunks[0].choices[0].logprobs.tokens == whole.logprobs.tokens[:len(tokenizer.encode(PROMPT))]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == whole.logprobs.tokens
    assert [o for s in streamed for o in s.text_offset] == whole.logprobs.text_offset
    bare = complete(stack, PROMPT, max_tokens=MAX_NEW, echo=True).choices[0]
    assert (bare.text, bare.logprobs) == (whole.text, None)
    bare_chunks = list(complete(stack, PROMPT, max_tokens=MAX_NEW, echo=True, stream=True))
    assert bare_chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in bare_chunks) == whole.text


def test_max_tokens_0_with_echo_scores_the_prompt_alone(stack, spelling, hf_logprobs) -> None:
    """lm-eval's loglikelihood request, without the token it asks for but does not read: no generation step runs,
    and no session outlives the call."""
    steps_before = verifier_info(stack)
    reply = complete(stack, LONG[:40], max_tokens=0, logprobs=1, echo=True, n=2)
    for choice in reply.choices:
        assert choice.finish_reason == "length" and choice.logprobs.tokens == [spelling.text(t) for t in LONG[:40]]
        assert_echoed(choice.logprobs, LONG[:40], tail(choice.logprobs, 40), spelling, hf_logprobs, 1)
    assert reply.choices[0].text == reply.choices[1].text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (40, 0)
    assert reply.model_extra["ddtree"]["steps"] == 0
    assert Client(stack.addresses["gateway"], api_key=KEY).list_sessions() == []
    assert verifier_info(stack).active_sessions == steps_before.active_sessions == 0


def test_n_choices_each_echo_the_prompt(stack, spelling, hf_logprobs) -> None:
    reply = complete(stack, LONG[:50], max_tokens=MAX_NEW, logprobs=1, echo=True, n=2)
    plain = complete(stack, LONG[:50], max_tokens=MAX_NEW, logprobs=1).choices[0]
    for choice in reply.choices:
        assert choice.text.endswith(plain.text)
        assert_echoed(choice.logprobs, LONG[:50], plain.logprobs, spelling, hf_logprobs, 1)


def test_echo_of_text_appended_to_a_session_scores_its_first_token_too(stack, spelling, hf_logprobs) -> None:
    """A session's KV is reused (a fork of it, then the session itself): the appended tokens' prefill scores them,
    each given the session before it, the first one too."""
    client = Client(stack.addresses["gateway"], api_key=KEY)
    first = client.generate(token_ids=LONG[:30], max_new_tokens=4, keep_session=True)
    first.result()
    context, turn = LONG[:30] + first.token_ids, LONG[30:60]
    for ddtree in ({"session": first.summary.session, "fork": True}, {"session": first.summary.session}):
        logprobs = complete(stack, turn, max_tokens=2, logprobs=0, echo=True, ddtree=ddtree).choices[0].logprobs
        assert_echoed(logprobs, turn, tail(logprobs, len(turn)), spelling, hf_logprobs, 0, first_scored=True,
                      context=context)
    client.release_session(first.summary.session)


def tail(logprobs, start: int) -> SimpleNamespace:
    """The generated part of completions' `logprobs` (from `start`)."""
    return SimpleNamespace(tokens=logprobs.tokens[start:], token_logprobs=logprobs.token_logprobs[start:])


def test_vllm_prompt_logprobs_hold_the_token_its_rank_and_the_best(stack, spelling, hf_logprobs) -> None:
    prompt = LONG[:60]
    reply = complete(stack, prompt, max_tokens=2, prompt_logprobs=3)
    (choice,) = reply.choices
    scored = choice.model_extra["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None and choice.logprobs is None
    values, rows = expected_rows(hf_logprobs, prompt, list(range(1, len(prompt))))
    top = rows.topk(3, dim=-1)
    for token, entry, value, row, ids, best in zip(prompt[1:], scored[1:], values.tolist(), rows,
                                                   top.indices.tolist(), top.values.tolist()):
        own = entry[str(token)]  # NOTE: JSON keys are strings
        assert own["logprob"] == pytest.approx(value, abs=1e-4) and own["decoded_token"] == spelling.text(token)
        assert own["rank"] == 1 + int((row > row[token]).sum())
        assert set(entry) == {str(i) for i in [token, *ids]}
        for rank, (i, v) in enumerate(zip(ids, best), start=1):
            if i != token:
                assert entry[str(i)]["logprob"] == pytest.approx(v, abs=1e-4) and entry[str(i)]["rank"] == rank


def test_grpc_prompt_logprobs_on_generate_and_create_session(stack, hf_logprobs) -> None:
    client = Client(stack.addresses["gateway"], api_key=KEY)
    values, _ = expected_rows(hf_logprobs, LONG, list(range(1, len(LONG))))
    generation = client.generate(token_ids=LONG, max_new_tokens=2, prompt_logprobs=2)
    generation.result()
    created = client.create_session(token_ids=LONG, prompt_logprobs=2)
    for scored in (generation.prompt, created.prompt_logprobs):
        assert list(scored.token_ids) == LONG and len(scored.logprobs) == len(LONG) - 1
        assert [lp.logprob for lp in scored.logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert all(len(lp.top_token_ids) == 2 and lp.rank >= 1 for lp in scored.logprobs)
    client.release_session(created.session.session)
    assert client.generate(token_ids=LONG[:5], max_new_tokens=2).prompt is None  # none unless asked
    single = client.generate(token_ids=LONG[:1], max_new_tokens=2, prompt_logprobs=0)
    single.result()
    assert list(single.prompt.token_ids) == LONG[:1] and len(single.prompt.logprobs) == 0
    for call in (lambda: client.generate(PROMPT, max_new_tokens=2, prompt_logprobs=21).result(),
                 lambda: client.create_session(PROMPT, prompt_logprobs=-1)):
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("prompt_logprobs: ")


@pytest.mark.parametrize("fields, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"prompt_logprobs": 2**40}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": -1, "max_tokens": 0}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "ddtree": {"session": "0" * 48}}, "max_tokens"),
])
def test_bad_echo_and_prompt_logprobs_name_the_field(stack, fields: dict, param: str) -> None:
    fields = {"max_tokens": 4, **fields}
    with pytest.raises(openai.APIStatusError) as caught:
        complete(stack, PROMPT, **fields)
    error = caught.value
    assert error.status_code == 400 and error.body["param"] == param, error.body
    assert error.body["message"].startswith(f"{param}: ")


def test_chat_has_no_echo_nor_prompt_logprobs(stack) -> None:
    for fields, param in (({"echo": True}, "echo"), ({"prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(openai.APIStatusError) as caught:
            oai(stack).chat.completions.create(model=Path(stack.target).name, max_tokens=2, extra_body=fields,
                                               messages=[{"role": "user", "content": "hi"}])
        assert caught.value.status_code == 400 and caught.value.body["param"] == param
