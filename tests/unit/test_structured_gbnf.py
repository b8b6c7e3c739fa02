"""llama.cpp's GBNF grammars (structured_outputs.grammar with `::=`) convert to llguidance's Lark;
a grammar the converter cannot read is a ValueError (the gateway's 400), whatever it raises."""
from __future__ import annotations

import pytest

from specd.structured import StructuredOutput, check, grammar_text


def test_a_gbnf_grammar_converts():
    text = grammar_text(StructuredOutput(grammar='root ::= "yes" | "no"'))
    assert " ".join(text.split()) == '%llguidance {} start: "yes" | "no"', text
    check(StructuredOutput(grammar='root ::= "yes" | "no"'))


@pytest.mark.parametrize("grammar", ["root ::= (", 'x ::= "a"', 'root ::= "\\'])
def test_a_malformed_gbnf_grammar_is_a_value_error(grammar):
    with pytest.raises(ValueError, match="GBNF grammar"):
        grammar_text(StructuredOutput(grammar=grammar))
