"""The loaders' pure-Python facts (``magicpig_jax.io``) against independent references: the GGUF
block table of :mod:`magicpig_jax.io.gguf_blocks` against gguf-py's ``GGML_QUANT_SIZES`` and
type ids, row sizes by hand and as a round trip (hypothesis), and the exact messages.

Written for mutation testing (docs/mutation.md, "host/ and io/").
"""

from __future__ import annotations

import re

import gguf
import pytest
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given
from hypothesis import strategies as st

from magicpig_jax.io import gguf_blocks
from magicpig_jax.io.gguf_blocks import (
    BLOCK_SIZE,
    QUANT_TYPES,
    block_bytes,
    block_weights,
    packed_row_bytes,
    row_weights,
)


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def test_quant_types_are_gguf_pys():
    assert sorted(QUANT_TYPES) == ["BF16", "F16", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    assert BLOCK_SIZE == 32
    for name, (type_id, nbytes, nweights) in QUANT_TYPES.items():
        t = gguf.GGMLQuantizationType[name]
        assert type_id == int(t), name
        assert (nweights, nbytes) == GGML_QUANT_SIZES[t], name
        assert block_bytes(name) == nbytes and block_weights(name) == nweights


def test_row_sizes_by_hand_and_messages():
    assert packed_row_bytes("Q4_1", 64) == 40
    assert packed_row_bytes("Q6_K", 512) == 420
    assert packed_row_bytes("F16", 3) == 6
    assert row_weights("Q4_1", 40) == 64
    assert row_weights("Q6_K", 420) == 512
    assert row_weights("BF16", 6) == 3
    bad_type = "qtype must be one of ['BF16', 'F16', 'Q4_0', 'Q4_1', 'Q4_K', 'Q5_0', 'Q5_1', 'Q5_K', 'Q6_K', " \
               "'Q8_0'], got 'Q2_K'"
    for f in (block_bytes, block_weights):
        with pytest.raises(ValueError, match=_exact(bad_type)):
            f("Q2_K")
    with pytest.raises(ValueError, match=_exact(bad_type)):
        packed_row_bytes("Q2_K", 32)
    with pytest.raises(ValueError, match=_exact(bad_type)):
        row_weights("Q2_K", 20)
    for n in (0, -32, 48, 32.0, True):
        message = f"in_features must be a positive multiple of 32 for Q8_0, got {n!r}"
        with pytest.raises(ValueError, match=_exact(message)):
            packed_row_bytes("Q8_0", n)
    for n in (0, -34, 35, 34.0):
        with pytest.raises(ValueError, match=_exact(f"a packed Q8_0 row must be a positive multiple of 34 bytes, "
                                                    f"got {n!r}")):
            row_weights("Q8_0", n)
    assert gguf_blocks.row_weights("F16", 2) == 1 and gguf_blocks.packed_row_bytes("F16", 1) == 2


@given(st.sampled_from(sorted(QUANT_TYPES)), st.integers(1, 64))
def test_row_sizes_round_trip(qtype, blocks):
    nweights, nbytes = GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert packed_row_bytes(qtype, blocks * nweights) == blocks * nbytes
    assert row_weights(qtype, blocks * nbytes) == blocks * nweights
    assert type(packed_row_bytes(qtype, blocks * nweights)) is int and type(row_weights(qtype, nbytes)) is int


# -- chat_template -------------------------------------------------------------------------------


def test_chat_template_tojson_passes_its_arguments_to_json_dumps():
    import json

    from magicpig_jax.io.chat_template import render_chat_template

    data = {"b": "é", "a": [1, 2]}
    cases = [("", {}), ("indent=2", {"indent": 2}), ("separators=(',', ':')", {"separators": (",", ":")}),
             ("sort_keys=true", {"sort_keys": True}), ("ensure_ascii=true", {"ensure_ascii": True})]
    for args, kw in cases:
        template = "{{ data | tojson(" + args + ") }}"
        assert render_chat_template(template, [], data=data) == json.dumps(data, **{"ensure_ascii": False, **kw})


def test_chat_template_errors_name_the_error_type_and_message():
    from magicpig_jax.io.chat_template import ChatTemplateError, render_chat_template

    with pytest.raises(ChatTemplateError, match=_exact("the chat template failed: TemplateError: no system role")):
        render_chat_template("{{ raise_exception('no system role') }}", [])
    # a Python error while rendering (not a Jinja one) is named by its type too
    with pytest.raises(ChatTemplateError, match=_exact("the chat template failed: ZeroDivisionError: integer division "
                                                       "or modulo by zero")):
        render_chat_template("{{ n // 0 }}", [], n=1)


def test_chat_template_variables_and_the_generation_tag():
    from magicpig_jax.io.chat_template import render_chat_template

    messages = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})  # any sequence
    template = ("{{ messages | length }}{% for m in messages %}[{% generation %}{{ m.content }}{% endgeneration %}]"
                "{% endfor %}{{ add_generation_prompt }}")
    assert render_chat_template(template, messages) == "2[a][b]True"
    assert render_chat_template(template, messages, add_generation_prompt=False) == "2[a][b]False"
    both = "{{ bos_token is defined }} {{ eos_token is defined }}"
    assert render_chat_template(both, []) == "False False"
    assert render_chat_template(both, [], bos_token="<s>") == "True False"
    assert render_chat_template(both, [], eos_token="</s>") == "False True"
    assert render_chat_template("{{ bos_token }}|{{ eos_token }}|{{ tools is none }}", [], bos_token="<s>",
                                eos_token="</s>") == "<s>|</s>|True"
    assert render_chat_template("{{ tools }} {{ documents }}", [], tools=[1]) == "[1] None"
