"""The llguidance guide: masks that allow exactly what the grammar allows, done right after the closing
brace, compiled grammars cached, refusals with a reason, and no sampling setting that escapes the mask."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app.serving.structured.guides import GrammarError, compiler_for, json_schema_grammar
from engine.sampling_params import SamplingParams
from tests.support.engine import chat_prompt, make_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(smollm2):
    return compiler_for(smollm2.tokenizer)


def encode(smollm2, text: str) -> list[int]:
    return smollm2.tokenizer.encode(text, add_special_tokens=False)


def test_a_valid_document_is_allowed_token_by_token_and_done_after_the_closing_brace(smollm2, compiler):
    guide = compiler.compile(json_schema_grammar(PERSON)).new_guide()
    tokens = encode(smollm2, '{"name": "Ann", "age": 31, "pets": ["cat"]}')
    for token in tokens:
        assert not guide.done
        assert guide.allowed_tokens()[token]
        guide.advance(token)
    assert guide.done


def test_the_mask_forbids_what_the_schema_forbids(smollm2, compiler):
    guide = compiler.compile(json_schema_grammar(PERSON)).new_guide()
    vocab = smollm2.tokenizer
    start = '{"name": "'
    allowed_texts = [vocab.decode([token]) for token in guide.allowed_tokens().nonzero().flatten().tolist()]
    assert '{"' in allowed_texts and "[" not in allowed_texts
    assert all(start.startswith(text) or text.startswith(start) for text in allowed_texts)
    for token in encode(smollm2, '{"name": "Ann", "age": '):
        guide.advance(token)
    allowed = guide.allowed_tokens()
    assert allowed[vocab.convert_tokens_to_ids("3")] and not allowed[vocab.convert_tokens_to_ids('"')]
    assert not allowed[vocab.eos_token_id]


def test_each_sequence_gets_its_own_guide(smollm2, compiler):
    factory = compiler.compile(json_schema_grammar(PERSON))
    first, second = factory.new_guide(), factory.new_guide()
    for token in encode(smollm2, '{"name": '):
        first.advance(token)
    assert not second.allowed_tokens()[encode(smollm2, '"')[0]]
    assert first.allowed_tokens()[encode(smollm2, '"')[0]]


def test_compiled_grammars_are_cached_by_grammar(compiler):
    grammar = json_schema_grammar(PERSON)
    assert compiler.compile(grammar) is compiler.compile(grammar)
    assert compiler.compile(json_schema_grammar({"type": "object"})) is not compiler.compile(grammar)


@pytest.mark.parametrize(
    "schema, reason",
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
        ({"type": "string", "format": "color"}, "format"),
        ({"type": "number", "minimum": 5, "maximum": 1}, "Unsatisfiable"),
    ],
)
def test_schemas_that_cannot_be_enforced_are_refused_with_the_reason(compiler, schema, reason):
    with pytest.raises(GrammarError, match=reason):
        compiler.compile(json_schema_grammar(schema))


SETTINGS = [
    dict(temperature=2.0, top_p=1.0),
    dict(temperature=1.5, top_k=5, min_p=0.0, presence_penalty=2.0, frequency_penalty=2.0),
    dict(temperature=1.0, repetition_penalty=2.0, logit_bias={2: 100.0, 28: 100.0, 1159: 100.0}),
    dict(temperature=0.0, ignore_eos=True, min_tokens=5),
]


def test_no_sampling_setting_escapes_the_schema(smollm2, compiler):
    factory = compiler.compile(json_schema_grammar(PERSON))
    engine = make_engine(smollm2, num_kv_blocks=128)
    prompt = chat_prompt(smollm2.tokenizer, "Describe a person.")
    outputs: dict[str, list[int]] = {}
    for number, settings in enumerate(SETTINGS):  # one batch: the settings share the steps
        params = SamplingParams(n=1, seed=11, max_tokens=60, guide_factory=factory, **settings)
        engine.add_request(f"r{number}", prompt, params)
    while engine.has_unfinished:
        for output in engine.step():
            for delta in output.deltas:
                outputs.setdefault(f"{output.request_id}.{delta.index}", []).extend(delta.token_ids)
    assert len(outputs) == len(SETTINGS)
    for tokens in outputs.values():
        jsonschema.validate(json.loads(smollm2.tokenizer.decode(tokens)), PERSON)
