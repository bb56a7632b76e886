"""magicpig_jax.eval.tasks: the RULER-style generators and RULER's scoring.

Haystack: ``/usr/share/common-licenses`` (no apt package needed).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from magicpig_jax.eval import tasks
from magicpig_jax.eval.tasks import (
    TASKS,
    make_sample,
    postprocess_pred,
    score,
    string_match_all,
    string_match_part,
)


def approx_token_count(prompt: str, answer_prefix: str) -> int:
    """A model-free token count (about 4/3 tokens per whitespace word), so these tests need no tokenizer."""
    return math.ceil(len((prompt + " " + answer_prefix).split()) * 4 / 3)

HAY = "licenses"


# --- generators -------------------------------------------------------------------------------

@pytest.mark.parametrize("task", TASKS)
def test_generator_deterministic_and_answer_in_prompt(task):
    length = 3000
    a = make_sample(task, length, 0, approx_token_count, seed=1, haystack=HAY)
    b = make_sample(task, length, 0, approx_token_count, seed=1, haystack=HAY)
    c = make_sample(task, length, 1, approx_token_count, seed=1, haystack=HAY)
    assert a == b
    assert (a.prompt, a.outputs) != (c.prompt, c.outputs)
    assert a.outputs and all(o in a.prompt for o in a.outputs)
    n = approx_token_count(a.prompt, a.answer_prefix)
    assert 0.85 * (length - a.max_new_tokens) < n <= length - a.max_new_tokens


def test_niah_needles_and_answers():
    for task, (num_k, num_v, num_q) in tasks._NIAH.items():
        s = make_sample(task, 2000, 3, approx_token_count, haystack=HAY)
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", s.prompt)
        assert len(needles) == num_k * num_v
        assert len({k for k, _ in needles}) == num_k
        assert len(s.outputs) == num_q * num_v
        asked = re.search(r"What are all the special magic numbers for (.*) mentioned", s.prompt).group(1)
        for key, value in needles:  # the asked keys' values are exactly the expected outputs
            assert (value in s.outputs) == (key in asked)
        assert all(s.prompt.count(v) == 1 for v in s.outputs)  # values never occur elsewhere
        assert asked in s.answer_prefix


def test_vt_chain():
    s = make_sample("vt", 2000, 0, approx_token_count, haystack=HAY)
    stmts = re.findall(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d{5})\.", s.prompt)
    assert len(stmts) == 5 and list(s.outputs) == [x[0] for x in stmts]
    value = stmts[0][1]
    assert value.isdigit() and f"assigned the value {value}" in s.prompt
    for (_, _, prev), (name, _, _) in zip(stmts[1:], stmts[:-1], strict=True):
        assert prev == name  # each hop reads the previous variable


def test_cwe_and_fwe_frequencies():
    s = make_sample("cwe", 3000, 0, approx_token_count, haystack=HAY)
    listed = s.prompt.split("\n")[-2]  # the numbered list of the real question
    counts = Counter(re.findall(r"\d+\. ([a-z]+)", listed))
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(s.outputs) and min(counts[w] for w in s.outputs) == 6
    assert max(c for w, c in counts.items() if w not in s.outputs) == 1
    f = make_sample("fwe", 3000, 0, approx_token_count, haystack=HAY)
    words = Counter(f.prompt.split("coded words. ")[1].split("\nQuestion")[0].split())
    ranked = [w for w, _ in words.most_common(4)]
    assert ranked[0] == "..." and ranked[1:] == list(f.outputs)


def test_too_short_context_is_an_error():
    with pytest.raises(ValueError, match="too small"):
        make_sample("cwe", 100, 0, approx_token_count, haystack=HAY)
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("qa", 1000, 0, approx_token_count, haystack=HAY)


# --- scoring ----------------------------------------------------------------------------------

def test_scoring_matches_ruler():
    # RULER: sum over refs of [ref.lower() in pred.lower()] / len(refs)
    assert string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]) == 2 / 3
    assert string_match_all("ANSWER: Apple, banana", ["apple", "Banana"]) == 1.0
    assert string_match_all("", ["x"]) == 0.0
    assert string_match_all("12345678", ["1234567"]) == 1.0  # substring semantics, as RULER
    assert string_match_part("only the second", ["first", "second"]) == 1.0
    assert string_match_part("neither", ["first", "second"]) == 0.0
    assert postprocess_pred("  a\tb\x00c \n") == "a\nb\nc"
    assert score("vt", " they are: ABCDE, FGHIJ", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"]) == 0.5
    with pytest.raises(ValueError):
        string_match_all("x", [])


def test_a_needle_value_never_sits_inside_a_longer_number_of_the_haystack(tmp_path):
    """A 7-digit value was refused only where it occurred as a whole number: inside the haystack's
    957727603 it was drawn, and copying that number scored 1 (the scorer matches substrings).
    A reviewer's finding."""
    para = "This is a plain sentence of prose that has more than twelve words in it for the haystack. " * 3
    plain = tmp_path / "plain.txt"
    plain.write_text((para.strip() + "\n\n") * 20)

    def count(p, a):
        return (len(p) + len(a)) // 4

    drawn = make_sample("niah_single", 1024, 0, count, haystack=str(plain)).outputs[0]
    extra = f"The serial number printed on every copy of this document is 9{drawn}3, to be kept with every copy."
    numbered = tmp_path / "numbered.txt"
    numbered.write_text((extra + "\n\n" + para.strip() + "\n\n") * 20)
    s = make_sample("niah_single", 1024, 0, count, haystack=str(numbered))
    assert f"9{drawn}3" in s.prompt and s.outputs[0] != drawn and s.prompt.count(s.outputs[0]) == 1
