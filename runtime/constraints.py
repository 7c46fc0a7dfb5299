"""Structured output: a request's grammar, its validation, and the matcher of one sequence.

A `Constraint` says what the output must match: any JSON object, a JSON schema, a regex,
or a Lark grammar (as llguidance reads it). llguidance does the grammar work: it compiles
the constraint, and per decode step it gives each constrained sequence a bitmask of the
tokens that can come next; `apply_grammar_masks` computes the masks of a batch's
constrained rows in one parallel call and sets the forbidden logits to -inf before the
sampler, so temperature, top-p, penalties, seeds and logprobs work as usual (logprobs are
then those of the constrained distribution).

`validate_constraint` needs no model: the API calls it at submission, so a bad schema is
refused with a 400 naming its field, never a failed job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np

from runtime.errors import InvalidSamplingParams
from runtime.limits import MAX_CONSTRAINT_CHARS

if TYPE_CHECKING:  # runtime.sampling imports this module, and the tokenizer imports sampling
    from runtime.grammar_vocab import GrammarVocab

JSON_OBJECT, JSON_SCHEMA, REGEX, GRAMMAR = "json_object", "json_schema", "regex", "grammar"
KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX, GRAMMAR)
DEFAULT_PARAMS = {
    JSON_OBJECT: "response_format",
    JSON_SCHEMA: "response_format",
    REGEX: "regex",
    GRAMMAR: "grammar",
}
"""The request field each kind comes from unless the caller names another."""
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON written on one line with fixed separators: small models otherwise loop on
whitespace. A schema's own "x-guidance" options override these."""


@dataclass(frozen=True)
class Constraint:
    """What a sequence's output must match.

    - `kind`: "json_object" (any JSON object; `value` None), "json_schema" (`value` the
      schema, a dict or its JSON text), "regex" (`value` the pattern, Rust regex syntax,
      matched against the whole output), "grammar" (`value` a Lark grammar, llguidance's
      dialect).
    - `param`: the request field it came from, named by errors (default per kind:
      "response_format" for the JSON kinds, else the kind).
    """

    kind: str
    value: Any = None
    param: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSamplingParams(
                f"a constraint's kind must be one of {', '.join(KINDS)}, got {self.kind!r}.",
                param=self.param or "response_format",
            )
        object.__setattr__(self, "param", self.param or DEFAULT_PARAMS[self.kind])
        object.__setattr__(self, "value", self._normalised_value())

    def _normalised_value(self) -> Any:
        value = self.value
        if self.kind == JSON_OBJECT:
            if value is not None:
                raise self._error(f"json_object takes no value, got {_short(value)}.")
            return None
        if self.kind == JSON_SCHEMA:
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise self._error(f"the JSON schema is not valid JSON: {exc}.") from exc
            if not isinstance(value, dict):
                raise self._error(f"a JSON schema must be a JSON object, got {_short(value)}.")
            size = len(json.dumps(value))
        else:
            if not isinstance(value, str):
                raise self._error(f"{self.kind} must be a string, got {_short(value)}.")
            size = len(value)
        if size > MAX_CONSTRAINT_CHARS:
            raise self._error(
                f"{self.kind} must be at most {MAX_CONSTRAINT_CHARS} characters, got {size}."
            )
        return value

    def _error(self, message: str) -> InvalidSamplingParams:
        return InvalidSamplingParams(message, param=self.param or DEFAULT_PARAMS[self.kind])

    @property
    def grammar(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: see `validate_constraint`)."""
        if self.kind == REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == GRAMMAR:
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        schema = {"type": "object"} if self.kind == JSON_OBJECT else self.value
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_WHAT = {
    JSON_OBJECT: "JSON object format",
    JSON_SCHEMA: "JSON schema",
    REGEX: "regex",
    GRAMMAR: "grammar",
}


def validate_constraint(constraint: Constraint, vocab: GrammarVocab | None = None) -> None:
    """Raise `InvalidSamplingParams` (with `param` set and llguidance's own message) if the
    constraint does not compile; `vocab` also checks it against a model's tokens."""
    tokenizer = vocab.lltokenizer if vocab is not None else None
    try:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            constraint.grammar, tokenizer
        )
    except ValueError as exc:
        failed, messages = True, [str(exc)]
    if failed:
        raise InvalidSamplingParams(
            f"invalid {_WHAT[constraint.kind]}: {messages[0].strip()}", param=constraint.param
        )


def constraint_from_request(body: Mapping[str, Any]) -> Constraint | None:
    """The constraint a request body asks for: `response_format` (chat: "json_object", or
    "json_schema" with `json_schema.schema`) or the extensions `json_schema`, `regex`,
    `grammar` (completions); None for none. At most one may be given."""
    found: list[Constraint] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    for kind in (JSON_SCHEMA, REGEX, GRAMMAR):
        if body.get(kind) is not None:
            found.append(Constraint(kind, body[kind], param=kind))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidSamplingParams(
            f"only one of response_format, json_schema, regex and grammar may constrain the "
            f"output, got {names}.",
            param=found[1].param,
        )
    return found[0] if found else None


def _from_response_format(response_format: Any) -> Constraint | None:
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == JSON_OBJECT:
        return Constraint(JSON_OBJECT)
    if kind == JSON_SCHEMA:
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping):
            raise InvalidSamplingParams(
                "response_format json_schema needs a json_schema object with a schema, got "
                f"{_short(spec)}.",
                param="response_format",
            )
        schema = spec.get("schema")
        return Constraint(JSON_OBJECT) if schema is None else Constraint(JSON_SCHEMA, schema)
    raise InvalidSamplingParams(
        f"response_format type must be text, json_object or json_schema, got {_short(kind)}.",
        param="response_format",
    )


class GrammarMatcher:
    """One constrained sequence's place in its grammar: which tokens may come next.

    Created when the sequence is added; `replay` feeds it the tokens an earlier run already
    generated (a resumed request). It follows every sampled token exactly once, so a
    preempted sequence, whose tokens are recomputed but not re-sampled, keeps its state.
    A matcher that fails (it should not: masks only allow what it accepts) records `error`.
    """

    def __init__(
        self, vocab: GrammarVocab, constraint: Constraint, replay: Sequence[int] = ()
    ) -> None:
        self.constraint = constraint
        self.matcher = llguidance.LLMatcher(vocab.lltokenizer, constraint.grammar)
        if self.matcher.is_error():
            raise InvalidSamplingParams(
                f"invalid {_WHAT[constraint.kind]}: {self.matcher.get_error().strip()}",
                param=constraint.param,
            )
        self.error: str | None = None
        if replay and not self.matcher.consume_tokens([int(t) for t in replay]):
            raise InvalidSamplingParams(
                f"the {len(replay)} tokens already generated do not follow the "
                f"{_WHAT[constraint.kind]}: {_first_line(self.matcher.get_error())}",
                param=constraint.param,
            )

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.error is None and self.matcher.is_stopped()

    def consume(self, token_id: int) -> None:
        if self.error is None and not self.matcher.consume_token(int(token_id)):
            self.fail(f"token {token_id} does not follow the {_WHAT[self.constraint.kind]}")

    def fail(self, reason: str) -> None:
        detail = _first_line(self.matcher.get_error())
        self.error = f"constrained decoding failed: {reason}" + (f" ({detail})" if detail else "")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def apply_grammar_masks(
    vocab: GrammarVocab, logits: np.ndarray, rows: Sequence[int], matchers: Sequence[GrammarMatcher]
) -> None:
    """Set to -inf, in place, the logits [B, V] that each of `rows` may not take next under
    its matcher; the masks of all rows are computed in one parallel call. A row whose
    matcher failed is left as it is and its matcher records the error."""
    n_vocab = logits.shape[1]
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), vocab.n_vocab)  # [n, V/32]
    jobs = [(m.matcher, i) for i, m in enumerate(matchers)]
    llguidance.numpy.fill_next_token_bitmask_par(vocab.executor, jobs, bitmask)
    # bit t of the little-endian words is token t
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=n_vocab, bitorder="little")
    allowed = allowed.view(bool)  # [n, V]
    for i, matcher in enumerate(matchers):
        if matcher.matcher.is_error() or not allowed[i].any():
            matcher.fail("the grammar allows no next token")
            allowed[i] = True
    if list(rows) == list(range(logits.shape[0])):
        np.putmask(logits, ~allowed, -np.inf)  # every row constrained: no copies
        return
    sub = logits[rows]  # [n, V] copy
    np.putmask(sub, ~allowed, -np.inf)
    logits[rows] = sub
