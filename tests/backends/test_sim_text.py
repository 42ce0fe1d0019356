"""The simulated engines' synthetic output (backends/sim/text.py): deterministic, one token
per word by the shared counter, and vLLM's rules for max_tokens, min_tokens, ignore_eos and
stop strings."""
from __future__ import annotations

import statistics

import pytest

from backends.sim.text import (MEDIAN_TOKENS, VOCAB, intrinsic_length, plan_output,
                               request_key, words)
from dse.tokens import count_tokens


def test_every_word_is_one_token_and_texts_add_up():
    assert all(count_tokens(w) == 1 for w in VOCAB)
    key = request_key("Tell me a story", 3)
    for n in (1, 7, 200, 1000):
        assert count_tokens("".join(words(key, 0, n))) == n
    # a prompt and its output count as the sum of both (the gateway relies on it)
    prompt = "Tell me a story about a river."
    out = "".join(words(key, 0, 50))
    assert count_tokens(prompt + out) == count_tokens(prompt) + 50


def test_output_depends_only_on_prompt_seed_and_position():
    a = plan_output("hello there", max_tokens=300, seed=1)
    b = plan_output("hello there", max_tokens=300, seed=1)
    assert a.total == b.total and a.full_text() == b.full_text()
    assert plan_output("hello there", max_tokens=300, seed=2).full_text() != a.full_text()
    # pieces concatenate to the whole, wherever they are cut (continuations on other vPods)
    t = a.total
    cuts = [0, 1, 5, t // 2, t]
    assert "".join(a.text(x, y) for x, y in zip(cuts, cuts[1:])) == a.full_text()


def test_intrinsic_lengths_are_lognormal_around_the_median():
    lens = [intrinsic_length(request_key(f"prompt {i}", None)) for i in range(4000)]
    assert min(lens) >= 1
    assert 0.85 * MEDIAN_TOKENS < statistics.median(lens) < 1.15 * MEDIAN_TOKENS
    assert 0.02 < sum(n > 4 * MEDIAN_TOKENS for n in lens) / len(lens) < 0.15


def test_max_tokens_min_tokens_and_ignore_eos():
    prompt = next(p for p in (f"q{i}" for i in range(1000))
                  if 20 < intrinsic_length(request_key(p, None)) < 200)
    eos = intrinsic_length(request_key(prompt, None))
    p = plan_output(prompt, max_tokens=1000)
    assert (p.total, p.finish_reason) == (eos, "stop")
    p = plan_output(prompt, max_tokens=eos - 1)
    assert (p.total, p.finish_reason) == (eos - 1, "length")
    p = plan_output(prompt, max_tokens=eos)
    assert (p.total, p.finish_reason) == (eos, "stop")
    p = plan_output(prompt, max_tokens=1000, min_tokens=eos + 10)
    assert (p.total, p.finish_reason) == (eos + 10, "stop")
    p = plan_output(prompt, max_tokens=700, ignore_eos=True)
    assert (p.total, p.finish_reason) == (700, "length")
    assert count_tokens(p.full_text()) == 700


def test_stop_strings_cut_the_text_and_count_the_token_that_completed_them():
    base = plan_output("a story", max_tokens=200, ignore_eos=True)
    toks = [base.text(i, i + 1) for i in range(base.total)]
    j = 30
    stop = toks[j] + toks[j + 1]           # spans two tokens: completed by token j+1
    first = next(i for i in range(len(toks) - 1) if toks[i] + toks[i + 1] == stop)
    p = plan_output("a story", max_tokens=200, ignore_eos=True, stop=["never-there", stop])
    assert p.finish_reason == "stop" and p.stop_reason == stop
    assert p.total == first + 2
    assert p.full_text() == "".join(toks[:first])
    assert stop not in p.full_text()
    # pieces never run past the cut (a stream shows exactly the final text)
    assert "".join(p.text(i, i + 1) for i in range(p.total)) == p.full_text()
    # stop strings are not checked before min_tokens (vLLM)
    q = plan_output("a story", max_tokens=200, ignore_eos=True, stop=[stop],
                    min_tokens=first + 5)
    assert q.total >= first + 5
    assert q.full_text().startswith("".join(toks[:first + 2]))   # the early match is kept


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_outputs(n):
    p = plan_output("x", max_tokens=n, ignore_eos=True)
    assert p.total == n and count_tokens(p.full_text()) == n
