"""The gateway's pure parts: request validation and response formats (router.openai_api), the
default output-length predictor (router.predict), prompt-token counting (dse.tokens)."""

import json

import pytest

from dse import NeuScaleError
from dse.tokens import chat_prompt, count_tokens, load_tokenizer
from router.openai_api import CHAT, COMPLETIONS, APIError, Formatter, parse_request
from router.predict import LengthPredictor, MedianPredictor


def parse(kind, **body):
    return parse_request(kind, json.dumps(body).encode())


def err(kind, body) -> APIError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(APIError) as e:
        parse_request(kind, raw)
    return e.value


def test_valid_requests_keep_only_known_fields():
    r = parse(COMPLETIONS, model="m", prompt="hi", max_tokens=5, stop="x", seed=3,
              temperature=0.5, user="u", unknown_field=1, kv_transfer_params={"x": 1})
    assert r.upstream == {"model": "m", "prompt": "hi", "stop": ["x"], "seed": 3,
                          "temperature": 0.5}
    assert r.max_tokens == 5 and not r.stream and r.prompt == "hi"
    c = parse(CHAT, model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
              stream_options={"include_usage": True}, max_completion_tokens=7, max_tokens=3,
              ignore_eos=True, min_tokens=2)
    assert c.max_tokens == 7 and c.include_usage and not c.continuous_usage and c.stream
    assert c.prompt == chat_prompt([{"role": "user", "content": "hi"}])
    assert c.upstream["ignore_eos"] is True and c.min_tokens == 2
    assert parse(COMPLETIONS, model="m", prompt=["one"]).prompt == "one"


@pytest.mark.parametrize("kind,body,param,code", [
    (COMPLETIONS, b"{not json", None, None),
    (COMPLETIONS, b"[1, 2]", None, None),
    (COMPLETIONS, {"prompt": "x"}, "model", "missing_required_parameter"),
    (COMPLETIONS, {"model": 3, "prompt": "x"}, "model", "invalid_type"),
    (COMPLETIONS, {"model": "m"}, "prompt", "missing_required_parameter"),
    (COMPLETIONS, {"model": "m", "prompt": ""}, "prompt", "invalid_value"),
    (COMPLETIONS, {"model": "m", "prompt": ["a", "b"]}, "prompt", "unsupported_value"),
    (COMPLETIONS, {"model": "m", "prompt": 5}, "prompt", "invalid_type"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens",
     "integer_below_min_value"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens",
     "invalid_type"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 2.5}, "max_tokens",
     "invalid_type"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "n": 2}, "n", "unsupported_value"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "temperature": 3}, "temperature",
     "invalid_value"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature",
     "invalid_type"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "top_p": 1.5}, "top_p", "invalid_value"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "stream": "yes"}, "stream", "invalid_type"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "invalid_value"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "stop": [1]}, "stop", "invalid_type"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "max_tokens": 2, "min_tokens": 3},
     "min_tokens", "invalid_value"),
    (COMPLETIONS, {"model": "m", "prompt": "x", "echo": True}, "echo", "unsupported_value"),
    (CHAT, {"model": "m"}, "messages", "missing_required_parameter"),
    (CHAT, {"model": "m", "messages": []}, "messages", "empty_array"),
    (CHAT, {"model": "m", "messages": "hi"}, "messages", "invalid_type"),
    (CHAT, {"model": "m", "messages": [{"content": "hi"}]}, "messages[0].role",
     "missing_required_parameter"),
    (CHAT, {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role", "invalid_value"),
    (CHAT, {"model": "m", "messages": [{"role": "user"}]}, "messages[0].content",
     "missing_required_parameter"),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": 7}]},
     "messages[0].content", "invalid_type"),
])
def test_bad_requests_get_openai_errors(kind, body, param, code):
    e = err(kind, body)
    assert e.status == 400
    b = e.body()["error"]
    assert b["type"] == "invalid_request_error" and b["param"] == param and b["code"] == code
    assert b["message"]


def test_formatter_chunks_and_responses_are_openai_shaped():
    f = Formatter(CHAT, "m", id="chatcmpl-1", created=7)
    role = json.loads(f.role_chunk()[6:])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    c = json.loads(f.text_chunk(' a "q"', None, '{"prompt_tokens":1,"completion_tokens":2,'
                                              '"total_tokens":3}')[6:])
    assert c["id"] == "chatcmpl-1" and c["object"] == "chat.completion.chunk"
    assert c["choices"][0]["delta"]["content"] == ' a "q"' and c["usage"]["total_tokens"] == 3
    end = json.loads(f.text_chunk("", "stop")[6:])
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    u = json.loads(f.usage_chunk('{"prompt_tokens":1}')[6:])
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 1}
    whole = json.loads(f.response("hi", "length", 3, 4))
    assert whole["object"] == "chat.completion" and whole["usage"]["total_tokens"] == 7
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    g = Formatter(COMPLETIONS, "m")
    assert g.id.startswith("cmpl-")
    t = json.loads(g.text_chunk("x", "length")[6:])
    assert t["object"] == "text_completion" and t["choices"][0]["text"] == "x"
    assert json.loads(g.response("x", "stop", 1, 1))["choices"][0]["finish_reason"] == "stop"


def test_median_predictor_prior_median_and_conditional_repredict():
    p = MedianPredictor(prior_tokens=100, min_samples=4, window=8)
    assert isinstance(p, LengthPredictor)
    assert p.predict("x", 50) == 100                   # prior until the bucket has samples
    for n in (10, 20, 30, 40, 500):
        p.observe(50, n)
    assert p.predict("x", 60) == 30                    # same bucket (<= 128 tokens)
    assert p.predict("x", 5000) == 100                 # another bucket: still the prior
    assert p.repredict("x", 50, 5) == 30               # median of the ones longer than 5
    assert p.repredict("x", 50, 35) == max(70, 100)    # too few longer: twice, or the prior
    for n in range(1000, 1010):                        # the window keeps the last 8
        p.observe(50, n)
    assert p.predict("x", 50) == 1006                  # 1002..1009: the upper median
    with pytest.raises(ValueError):
        MedianPredictor(prior_tokens=0)


def test_token_estimate_is_documented_and_additive():
    assert count_tokens("") == 0
    assert count_tokens("hello world") == 2
    assert count_tokens(" hello tokenization") == 3     # 12 letters: 2 tokens
    assert count_tokens("12345") == 2 and count_tokens("a  b\n\nc") == 5
    words = " alpha bravo delta echo"
    assert count_tokens(words) == 4 and count_tokens(words * 50) == 200
    s = "The quick brown fox jumps over the lazy dog."
    assert count_tokens(s + words) == count_tokens(s) + count_tokens(words)
    p = chat_prompt([{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                  {"type": "image_url", "image_url": {}}]},
                     {"role": "assistant", "content": None}])
    assert p == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n\n<|assistant|>\n"


def test_real_tokenizer_file_loads_offline(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "!": 3}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    count = load_tokenizer(tmp_path)                     # the folder or the file
    assert count("hello world!") == 3 and count("") == 0
    assert load_tokenizer(tmp_path / "tokenizer.json")("hello hello") == 2
    with pytest.raises(NeuScaleError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(NeuScaleError, match="cannot read"):
        load_tokenizer(tmp_path / "bad.json")
