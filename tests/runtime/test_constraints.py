"""Structured output: constraints, their validation, and constrained decoding in the generator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import llguidance
import pytest

from runtime.constraints import Constraint, constraint_from_request, validate_constraint
from runtime.engine import Engine
from runtime.errors import InvalidSamplingParams
from runtime.sampling import SamplingParams
from tests.runtime.generation_helpers import GREEDY, random_tokens, run_all, tight_engine

PHONE = "[0-9]{3}-[0-9]{4}"
# bounded, so even a tiny random model finishes it well within max_tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
SEEDS = [dict(temperature=1.0, seed=s) for s in range(3)]


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Engine:
    return Engine.load(str(tiny_model_path))


def _generate(engine: Engine, prompt: list[int], params: SamplingParams, **add) -> list:
    return run_all(engine.new_generator(), {"r": (prompt, params)}, r=add)["r"]


def _text(events: list) -> str:
    return "".join(e.text for e in events)


def _assert_follows(engine: Engine, constraint: Constraint, token_ids: list[int]) -> None:
    """Each token was allowed where it came, checked by a fresh llguidance matcher."""
    matcher = llguidance.LLMatcher(engine.grammar_vocab.lltokenizer, constraint.grammar)
    for token in token_ids:
        assert matcher.consume_token(token), matcher.get_error()


# ------------------------------------------------------------------ constraints alone


@pytest.mark.parametrize(
    ("constraint", "param", "words"),
    [
        (Constraint("regex", "[0-9"), "regex", "unclosed character class"),
        (Constraint("grammar", "start: item\n"), "grammar", 'unknown name: "item"'),
        (Constraint("json_schema", {"type": "objekt"}), "response_format", "objekt"),
        (Constraint("json_schema", '{"minimum": "x"}', "json_schema"), "json_schema", "minimum"),
    ],
)
def test_validate_constraint_names_the_field_and_gives_llguidance_words(constraint, param, words):
    with pytest.raises(InvalidSamplingParams, match=re.escape(words)) as caught:
        validate_constraint(constraint)
    assert caught.value.param == param
    assert str(caught.value).startswith("invalid ")


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_object"),
        Constraint("json_schema", PERSON),
        Constraint("json_schema", json.dumps({"type": "array", "items": {"type": "string"}})),
        Constraint("regex", PHONE),
        Constraint("grammar", 'start: "a" | "b"'),
    ],
)
def test_valid_constraints_pass_validation(constraint):
    validate_constraint(constraint)


@pytest.mark.parametrize(
    ("kind", "value", "param", "words"),
    [
        ("xml", "x", "response_format", "kind must be one of"),
        ("json_object", {"type": "object"}, "response_format", "takes no value"),
        ("json_schema", "{not json", "response_format", "not valid JSON"),
        ("json_schema", [1, 2], "response_format", "must be a JSON object"),
        ("regex", 5, "regex", "regex must be a string"),
        ("grammar", "x" * 100_001, "grammar", "at most 100000 characters"),
    ],
)
def test_malformed_constraints_are_refused_when_made(kind, value, param, words):
    with pytest.raises(InvalidSamplingParams, match=words) as caught:
        Constraint(kind, value)
    assert caught.value.param == param


def test_constraint_from_request_reads_the_contract_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    }
    assert constraint_from_request(chat) == Constraint("json_schema", schema, "response_format")
    assert constraint_from_request({"response_format": {"type": "json_object"}}) == Constraint(
        "json_object"
    )
    assert constraint_from_request({"response_format": {"type": "text"}}) is None
    assert constraint_from_request({"prompt": "x"}) is None
    assert constraint_from_request({"regex": "a+"}) == Constraint("regex", "a+", "regex")
    assert constraint_from_request({"grammar": 'start: "a"'}).param == "grammar"
    assert constraint_from_request({"json_schema": schema}).param == "json_schema"
    with pytest.raises(InvalidSamplingParams, match="only one of") as caught:
        constraint_from_request({"regex": "a", "grammar": 'start: "a"'})
    assert caught.value.param == "grammar"
    with pytest.raises(InvalidSamplingParams, match="response_format type") as caught:
        constraint_from_request({"response_format": {"type": "yaml"}})
    assert caught.value.param == "response_format"


def test_sampling_params_take_only_a_constraint():
    with pytest.raises(InvalidSamplingParams, match="constraint must be"):
        SamplingParams(constraint={"kind": "regex", "value": "a"})


def test_an_invalid_constraint_is_refused_before_the_request_joins(engine):
    generator = engine.new_generator()
    params = SamplingParams(constraint=Constraint("regex", "(a"))
    with pytest.raises(InvalidSamplingParams) as checked:
        generator.check_request([20, 21], params)
    assert checked.value.param == "regex"
    with pytest.raises(InvalidSamplingParams):
        generator.add("r", [20, 21], params)
    assert len(generator) == 0


# ------------------------------------------------------------------ constrained decoding


@pytest.mark.parametrize("sampling", [GREEDY, *SEEDS], ids=["greedy", "seed0", "seed1", "seed2"])
def test_regex_output_matches_and_every_token_was_allowed(engine, sampling):
    constraint = Constraint("regex", PHONE)
    params = SamplingParams(max_tokens=20, constraint=constraint, **sampling)
    events = _generate(engine, random_tokens(12, seed=1), params)
    assert re.fullmatch(PHONE, _text(events))
    assert events[-1].finish_reason == "stop" and len(events) <= 8
    _assert_follows(engine, constraint, [e.token_id for e in events])


@pytest.mark.parametrize("sampling", [GREEDY, *SEEDS], ids=["greedy", "seed0", "seed1", "seed2"])
def test_json_schema_output_parses_and_validates(engine, sampling):
    constraint = Constraint("json_schema", PERSON)
    params = SamplingParams(max_tokens=80, constraint=constraint, **sampling)
    events = _generate(engine, random_tokens(12, seed=2), params)
    assert events[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(_text(events)), PERSON)
    _assert_follows(engine, constraint, [e.token_id for e in events])


def test_lark_grammar_output_is_in_the_language(engine):
    grammar = 'start: answer ("," answer)?\nanswer: "yes" | "no" | "maybe"\n'
    for seed in range(4):
        params = SamplingParams(
            max_tokens=20, temperature=1.0, seed=seed, constraint=Constraint("grammar", grammar)
        )
        text = _text(_generate(engine, random_tokens(8, seed=seed), params))
        assert re.fullmatch(r"(yes|no|maybe)(,(yes|no|maybe))?", text), text


def test_unconstrained_rows_give_the_tokens_they_give_alone(engine):
    plain = {
        "greedy": (random_tokens(15, seed=3), SamplingParams(max_tokens=12, **GREEDY)),
        "drawn": (random_tokens(9, seed=4), SamplingParams(max_tokens=12, temperature=1, seed=7)),
    }
    alone = run_all(engine.new_generator(), plain)
    constrained = {
        f"c{i}": (
            random_tokens(10 + i, seed=20 + i),
            SamplingParams(max_tokens=30, constraint=Constraint("json_schema", PERSON), **sampling),
        )
        for i, sampling in enumerate([GREEDY, *SEEDS])
    }
    generator = engine.new_generator()
    mixed = run_all(generator, {**constrained, **plain})
    for rid in plain:
        assert [e.token_id for e in mixed[rid]] == [e.token_id for e in alone[rid]]
    assert generator.grammar_rows > 0 and generator.grammar_seconds > 0


def test_unconstrained_batches_do_no_grammar_work(tiny_llama_path):
    engine = Engine.load(str(tiny_llama_path))
    generator = engine.new_generator()
    run_all(generator, {"r": (random_tokens(10, seed=5), SamplingParams(max_tokens=5, **GREEDY))})
    assert generator.grammar_rows == 0 and generator.grammar_seconds == 0
    assert engine.grammar_vocab._lltokenizer is None  # never even built


def test_sampling_options_still_apply_under_a_grammar(engine):
    seven = engine.encode("7", add_special=False)[0]
    params = SamplingParams(
        max_tokens=10, constraint=Constraint("regex", "[0-9]{3}"), logit_bias={seven: 100}
    )
    assert _text(_generate(engine, random_tokens(6, seed=6), params)) == "777"
    scored = SamplingParams(
        max_tokens=10, logprobs=20, constraint=Constraint("regex", "[0-9]"), **GREEDY
    )
    (event,) = _generate(engine, random_tokens(6, seed=6), scored)
    digits = {engine.encode(str(d), add_special=False)[0] for d in range(10)}
    # the constrained distribution: only digits, and their probabilities sum to 1
    assert {t for t, _ in event.top_logprobs} <= digits
    assert sum(2.718281828459045**lp for _, lp in event.top_logprobs) == pytest.approx(1, 1e-5)
    assert event.logprob == max(lp for _, lp in event.top_logprobs)


def test_stop_strings_still_apply_under_a_grammar(engine):
    params = SamplingParams(max_tokens=20, stop="-", constraint=Constraint("regex", PHONE))
    events = _generate(engine, random_tokens(12, seed=1), params)
    assert re.fullmatch("[0-9]{3}", _text(events)) and events[-1].finish_reason == "stop"


def test_with_ignore_eos_the_grammar_decides_the_end(engine):
    params = SamplingParams(max_tokens=50, constraint=Constraint("regex", "[0-9]{3}"), **GREEDY)
    events = _generate(engine, random_tokens(6, seed=8), params)
    assert re.fullmatch("[0-9]{3}", _text(events)) and events[-1].finish_reason == "stop"


def test_max_tokens_cuts_a_constrained_output_with_length(engine):
    params = SamplingParams(max_tokens=3, constraint=Constraint("regex", "[a-z]{10}"), **GREEDY)
    events = _generate(engine, random_tokens(6, seed=8), params)
    assert len(events) == 3 and events[-1].finish_reason == "length"


def test_resume_replays_the_sent_tokens_into_a_fresh_matcher(engine):
    constraint = Constraint("json_schema", PERSON)
    prompt = random_tokens(12, seed=9)
    params = SamplingParams(max_tokens=60, constraint=constraint, **GREEDY)
    full = [e.token_id for e in _generate(engine, prompt, params)]
    cut = len(full) // 2
    resumed = SamplingParams(max_tokens=60 - cut, constraint=constraint, **GREEDY)
    rest = _generate(engine, prompt + full[:cut], resumed, resume=cut)
    assert [e.token_id for e in rest] == full[cut:]
    text = engine.tokenizer.decode(full[:cut]) + _text(rest)
    jsonschema.validate(json.loads(text), PERSON)  # only a replayed matcher ends it right


def test_resume_with_tokens_outside_the_grammar_is_refused(engine):
    letters = engine.encode("abc", add_special=False)
    params = SamplingParams(max_tokens=10, constraint=Constraint("regex", PHONE))
    with pytest.raises(InvalidSamplingParams, match="do not follow the regex") as caught:
        engine.new_generator().add("r", [20, 21, *letters], params, resume=len(letters))
    assert caught.value.param == "regex"


def test_preemption_keeps_constrained_outputs_exact(tiny_model_path):
    constraints = [Constraint("regex", "[a-z ]{60}"), Constraint("json_schema", PERSON)]
    requests = {
        f"r{i}": (
            random_tokens(20 + 3 * i, seed=10 + i),
            SamplingParams(max_tokens=30, constraint=constraints[i % 2], **sampling),
        )
        for i, sampling in enumerate([GREEDY, *SEEDS])
    }
    expected = run_all(Engine.load(str(tiny_model_path)).new_generator(), requests)
    tight = tight_engine(tiny_model_path)  # 192 tokens: too few
    generator = tight.new_generator()
    got = run_all(generator, requests)
    assert generator.preemptions > 0
    for rid in requests:
        assert [e.token_id for e in got[rid]] == [e.token_id for e in expected[rid]]
        assert got[rid][-1].finish_reason is not None


def test_a_failed_matcher_ends_its_sequence_with_an_error_not_the_step(engine):
    generator = engine.new_generator()
    params = SamplingParams(max_tokens=8, constraint=Constraint("regex", PHONE), **GREEDY)
    generator.add("broken", random_tokens(6, seed=1), params)
    generator.add("fine", random_tokens(6, seed=2), params)
    letter = engine.encode("x", add_special=False)[0]
    generator._waiting[0].grammar.matcher.consume_token(letter)  # what should never happen
    events: dict[str, list] = {"broken": [], "fine": []}
    while len(generator):
        for event in generator.step():
            events[event.request_id].append(event)
    (only,) = events["broken"]
    assert only.finish_reason == "error" and "constrained decoding failed" in only.error
    assert re.fullmatch(PHONE, _text(events["fine"]))


# ------------------------------------------------------------------ real models


PHONE_CHAT = [{"role": "user", "content": "Invent a phone number."}]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["city", "country", "population_millions"],
    "additionalProperties": False,
}


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["smollm2_engine", "smollm2_torch_engine"])
def test_smollm2_json_schema_chat_answer_validates(request, engine_name):
    real = request.getfixturevalue(engine_name)
    messages = [{"role": "user", "content": "Describe Paris as JSON: city, country, population."}]
    params = SamplingParams(max_tokens=80, constraint=Constraint("json_schema", CITY), **GREEDY)
    events = _generate(real, real.encode_chat(messages), params)
    answer = json.loads(_text(events))
    jsonschema.validate(answer, CITY)
    assert events[-1].finish_reason == "stop"
    assert answer["city"] == "Paris"


@pytest.mark.slow
def test_smollm2_regex_answer_matches(smollm2_engine):
    params = SamplingParams(max_tokens=20, constraint=Constraint("regex", PHONE), **GREEDY)
    events = _generate(smollm2_engine, smollm2_engine.encode_chat(PHONE_CHAT), params)
    assert re.fullmatch(PHONE, _text(events)) and events[-1].finish_reason == "stop"


@pytest.mark.slow
def test_gemma_sentencepiece_vocabulary_constrains_a_generation(gemma3_engine):
    prompt = gemma3_engine.encode("The capital of France is")
    constraint = Constraint("regex", " [A-Z][a-z]+\\.")
    params = SamplingParams(max_tokens=10, constraint=constraint, **GREEDY)
    events = _generate(gemma3_engine, prompt, params)
    assert _text(events) == " Paris."
    assert events[-1].finish_reason == "stop"
