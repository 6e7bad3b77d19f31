"""protocol.py alone, with no server, thread or model: a completion body
parsed into ``Settings`` and the decoding ``Options``, its errors (status,
param and message, as OpenAI shapes them), stop strings cut from a growing
text, what a stream holds back, and the answer's body."""

import pytest

import protocol
from protocol import Choice, RequestError, Settings, completion_body, held_back, parse_completion
from speculative import GenerationResult, Options

MODEL = "t5-test"
LIMIT = 64


def parsed(**body) -> Settings:
    return parse_completion(body, LIMIT, MODEL)


def refused(body) -> RequestError:
    with pytest.raises(RequestError) as error:
        parse_completion(body, LIMIT, MODEL)
    return error.value


def test_a_body_becomes_settings_and_options():
    settings = parsed(
        prompt="translate: hi",
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        seed=3,
        stop="\n",
        stream=True,
        stream_options={"include_usage": True},
        model=MODEL,
    )
    assert settings.prompts == ["translate: hi"] and not settings.is_list
    assert settings.options == Options(max_tokens=20, temp=0.7, top_p=0.9, top_k=5, seed=3)
    assert settings.stop == ["\n"] and settings.stream and settings.stream_usage
    # The defaults: 100 tokens, or the server's limit if lower; greedy; no seed.
    assert parsed(prompt=["a", "b"]).options == Options(max_tokens=LIMIT)
    assert parsed(prompt=["a", "b"]).is_list


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ([], 400, None, "JSON object"),
        ({"prompt": ""}, 400, "prompt", "the prompt is empty"),
        ({"prompt": ["a", " "]}, 400, "prompt", "prompt 1 is empty"),
        ({"prompt": "a", "max_tokens": LIMIT + 1}, 400, "max_tokens", f"[1, {LIMIT}]"),
        ({"prompt": "a", "max_tokens": True}, 400, "max_tokens", "true"),
        ({"prompt": "a", "temperature": float("nan")}, 400, "temperature", ">= 0"),
        ({"prompt": "a", "seed": 2**64}, 400, "seed", "2**64"),
        ({"prompt": "a", "seed": True}, 400, "seed", "true"),
        ({"prompt": "a", "stop": ["x"] * 5}, 400, "stop", "at most 4"),
        ({"prompt": "a", "n": 2}, 400, "n", "list of prompts"),
        ({"prompt": "a", "best": 1}, 400, "best", "unknown parameter"),
        ({"prompt": "a", "model": "other"}, 404, "model", "does not exist"),
    ],
)
def test_bad_bodies_are_refused_with_openais_fields(body, status, param, words):
    error = refused(body)
    assert (error.status, error.param) == (status, param)
    assert words in error.message
    fields = error.body()["error"]
    assert fields["message"] == error.message and fields["param"] == param
    assert fields["type"] == "invalid_request_error"
    if status == 404:
        assert fields["code"] == "model_not_found"


def test_json_that_python_would_take_but_json_does_not_is_refused():
    assert protocol.parse_json(b'{"prompt": "a"}') == {"prompt": "a"}
    for body in (b'{"temperature": NaN}', b"{", b"\xff"):
        with pytest.raises(RequestError) as error:
            protocol.parse_json(body)
        assert error.value.status == 400


def result(text: str, tokens: int, finished: bool) -> GenerationResult:
    return GenerationResult(list(range(tokens)), text=text, finished=finished, prompt_tokens=3)


def test_a_stop_string_cuts_the_text_and_ends_the_choice():
    settings = parsed(prompt="a", stop=["END", "\n\n"], max_tokens=10)
    choice = Choice()
    assert not choice.update(result("one two", 2, False), settings)
    assert (choice.text, choice.finish_reason) == ("one two", None)
    assert choice.update(result("one two\n\nthree END", 5, False), settings)
    assert (choice.text, choice.finish_reason) == ("one two", "stop")


def test_a_finished_choice_says_why():
    settings = parsed(prompt="a", max_tokens=4)
    full, ended = Choice(), Choice()
    full.update(result("a b c d", 4, True), settings)
    ended.update(result("a b", 2, True), settings)
    assert (full.finish_reason, ended.finish_reason) == ("length", "stop")


def test_held_back_is_what_may_still_become_a_stop_string():
    assert held_back("the end of it", ["STOP"]) == 0
    assert held_back("the end ST", ["STOP"]) == 2
    assert held_back("the end S", ["xx", "STOP"]) == 1
    assert held_back("aaa", ["aaaa"]) == 3
    assert held_back("abc", []) == 0


def test_the_answer_and_a_chunk_carry_the_choices():
    settings = parsed(prompt=["a", "b"], max_tokens=4)
    choices = [Choice(), Choice()]
    choices[0].update(result("a b c d", 4, True), settings)
    choices[1].update(result("x", 1, True), settings)
    body = completion_body(choices, "cmpl-1", MODEL, 7)
    assert [c["text"] for c in body["choices"]] == ["a b c d", "x"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert body["model"] == MODEL and body["object"] == "text_completion"
    chunk = completion_body(choices, "cmpl-1", MODEL, 7, [None, ("x", "stop")])
    assert [c["index"] for c in chunk["choices"]] == [1] and "usage" not in chunk
    assert protocol.event(chunk).startswith("data: {") and protocol.event("[DONE]").endswith("\n\n")
