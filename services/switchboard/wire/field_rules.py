"""The bounds on an ``EngineCoreRequest``'s fields, as data that both sides apply.

Each rule names the wire field it bounds (``sampling_params.top_p``: the engine core's errors
name it) and the field of the API's ``GenerateRequest`` that feeds it (``sampling.top_p``: the
gateway's errors name it). The engine core checks every ADD against them
(``request_rules.check_engine_request``); the gateway checks the API request against the same
objects before it tokenizes or queues anything (``gateway/pipeline/``), so whatever the engine
would refuse is refused first, as the client's error naming the client's field. A bound added
here is enforced on both sides at once; ``tests/gateway/test_wire_bounds.py`` sends a request just
over and just under each one through every front.

Ranges follow vLLM and OpenAI where they have one (penalties in [-2, 2], logit bias in
[-100, 100], at most 20 logprobs); the caps that are ours bound the work one request can ask
for: a top-N of logprobs is computed per token, a bad word or a stop token id is matched per
step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence, Sized

from switchboard.common.constraint_grammar import MAX_SPEC_CHARS

MAX_LOGPROBS = 20  # top-N alternatives per output / prompt token (vLLM's default cap)
MAX_ABS_PENALTY = 2.0  # presence and frequency penalties (OpenAI)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI
MAX_REPETITION_PATTERN_SIZE = 256
MAX_REPETITION_COUNT = 256
MAX_TOKEN_LIST = 4096  # stop ids, allowed ids, logit-bias entries, bad words (each)
# A seed is handed to torch's generator, which takes what fits in 64 bits.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)  # the API's int32
MAX_REQUEST_ID_CHARS = 256  # a client's request id (it is echoed in the x-request-id header)
# The gateway names the engine requests of one call after the client's id: ``<i>_<id>`` for the
# n sequences of a Generate, ``<id>-<index>`` for the inputs of an Embed; the wire leaves room.
MAX_REQUEST_ID_SUFFIX_CHARS = 16
MAX_ENGINE_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS + MAX_REQUEST_ID_SUFFIX_CHARS


@dataclasses.dataclass(frozen=True)
class Range:
    """A finite number in ``[low, high]`` (``(low, ...`` when ``low_open``).

    ``each``: the rule holds for every value of the field (a mapping's values), and an error
    names the entry (``sampling.logit_bias[7]``). ``api_text``: how the API says the range where
    its field's type already keeps one side (an unsigned field: "at most 20")."""

    wire: str  # dotted path in EngineCoreRequest
    api: str  # dotted path in GenerateRequest
    low: float
    high: float = math.inf
    low_open: bool = False
    note: str = ""  # what a value means, after the range: "(1 = off)"
    each: bool = False
    api_text: str = ""
    derived: bool = False

    @property
    def text(self) -> str:
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        return f"{text} {self.note}" if self.note else text

    def keeps(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return self.low <= value <= self.high and not (self.low_open and value == self.low)

    def violation(self, value: object) -> str | None:
        """None when ``value`` keeps the rule; else what is wrong (the engine's words)."""
        if self.keeps(value):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        return f"must be {self.text}, got {value!r}"

    def api_message(self, field: str, value: object) -> str | None:
        """None when ``value`` keeps the rule; else the gateway's message naming ``field``."""
        if self.keeps(value):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"{field} must be a finite number, got {value}"
        return f"{field} must be {self.api_text or self.text}, got {value}"


@dataclasses.dataclass(frozen=True)
class MaxEntries:
    """At most ``limit`` entries (list items, mapping keys, characters, tokens).

    ``per_api_entry``: how many wire entries one entry of the API field can make (a bad word
    is banned as two token sequences: as it starts the text and after a space), so the API
    allows ``limit // per_api_entry``. ``each``: the rule holds for every entry of the field (a
    bad word's tokens), and an error names the entry (``sampling.bad_words[3]``). ``derived``:
    the wire value is made from the API field (a word's tokens, a constraint's spec), and the
    gateway checks it where it makes it."""

    wire: str
    api: str | None  # None: no client sets it (the model's own EOS ids)
    limit: int
    unit: str = "entries"
    per_api_entry: int = 1
    each: bool = False
    derived: bool = False

    @property
    def api_limit(self) -> int:
        return self.limit // self.per_api_entry

    def violation(self, items: Sized) -> str | None:
        return None if len(items) <= self.limit else f"at most {self.limit} {self.unit}"

    def api_message(self, field: str, size: int) -> str | None:
        return None if size <= self.api_limit else f"{field}: at most {self.api_limit} {self.unit}"


@dataclasses.dataclass(frozen=True)
class InVocabulary:
    """Every token id in ``[0, vocab_size)``: the worker indexes its embedding with them (a
    vocabulary size of 0 says nothing: then only a negative id is refused). A mapping's ids are
    its keys, and an error names the key (``sampling.logit_bias[7]``); a list's name the index
    (``stopping.stop_token_ids[2]``). ``each``: a list of lists (every bad word's ids)."""

    wire: str
    api: str | None
    each: bool = False
    derived: bool = False  # as MaxEntries.derived (a word's tokens, the truncated prompt)

    @staticmethod
    def first_outside(ids: Sequence[int], vocab_size: int) -> tuple[int, int] | None:
        """(index, id) of the first id outside the vocabulary, if any. min / max first: they
        scan at C speed, and a prompt can be long."""
        if not ids or (min(ids) >= 0 and (not vocab_size or max(ids) < vocab_size)):
            return None
        for i, token_id in enumerate(ids):
            if token_id < 0 or (vocab_size and token_id >= vocab_size):
                return i, token_id
        return None  # unreachable: min / max said there is one

    def violation(self, ids: Sequence[int] | Mapping[int, object], vocab_size: int) -> str | None:
        outside = self.first_outside(list(ids), vocab_size)
        if outside is None:
            return None
        token_id = outside[1]
        if token_id < 0:
            return f"token id {token_id} is negative"
        return f"token id {token_id} is out of range: the vocabulary has {vocab_size} tokens"

    def api_error(
        self, field: str, ids: Sequence[int] | Mapping[int, object], vocab_size: int
    ) -> tuple[str, str] | None:
        """(the entry's field, the gateway's message) for the first id outside the vocabulary
        (the API's ids are unsigned: only the upper end can be broken)."""
        outside = self.first_outside(list(ids), vocab_size) if vocab_size else None
        if outside is None:
            return None
        index, token_id = outside
        vocabulary = f"the vocabulary has {vocab_size} tokens"
        if isinstance(ids, Mapping):
            entry = f"{field}[{token_id}]"
            return entry, f"{entry}: token id {token_id} is out of range: {vocabulary}"
        entry = f"{field}[{index}]"
        return entry, f"{entry} = {token_id} is out of range: {vocabulary}"


Bound = Range | MaxEntries

# Derived on the gateway's side: a bad word's tokens are counted once it is tokenized
# (bad_words.py), a constraint's spec once it is written (constraint_check.py).
BAD_WORD_TOKENS = MaxEntries(
    "sampling_params.bad_words_token_ids",
    "sampling.bad_words",
    MAX_TOKEN_LIST,
    "tokens",
    each=True,
    derived=True,
)
STRUCTURED_SPEC = MaxEntries(
    "sampling_params.structured_output.spec",
    "structured_output",
    MAX_SPEC_CHARS,
    "characters",
    derived=True,
)

# Every bound on a single field. The rules between fields (min_tokens <= max_tokens <=
# max_model_len, min_pattern_size <= max_pattern_size) are in request_rules.py.
BOUNDS: tuple[Bound, ...] = (
    Range("priority", "priority", *PRIORITY_RANGE),
    Range("sampling_params.max_tokens", "stopping.max_tokens", 1),
    Range("sampling_params.temperature", "sampling.temperature", 0),
    Range("sampling_params.top_p", "sampling.top_p", 0, 1, low_open=True),
    Range("sampling_params.top_k", "sampling.top_k", -1, note="(0 or -1 = off)"),
    Range("sampling_params.min_p", "sampling.min_p", 0, 1),
    Range(
        "sampling_params.presence_penalty",
        "sampling.presence_penalty",
        -MAX_ABS_PENALTY,
        MAX_ABS_PENALTY,
    ),
    Range(
        "sampling_params.frequency_penalty",
        "sampling.frequency_penalty",
        -MAX_ABS_PENALTY,
        MAX_ABS_PENALTY,
    ),
    Range(
        "sampling_params.repetition_penalty",
        "sampling.repetition_penalty",
        0,
        low_open=True,
        note="(1 = off)",
    ),
    Range("sampling_params.seed", "sampling.seed", *SEED_RANGE),
    MaxEntries("sampling_params.stop_token_ids", "stopping.stop_token_ids", MAX_TOKEN_LIST),
    MaxEntries("sampling_params.eos_token_ids", None, MAX_TOKEN_LIST),
    MaxEntries("sampling_params.allowed_token_ids", "sampling.allowed_token_ids", MAX_TOKEN_LIST),
    MaxEntries("sampling_params.logit_bias", "sampling.logit_bias", MAX_TOKEN_LIST),
    Range(
        "sampling_params.logit_bias",
        "sampling.logit_bias",
        -MAX_ABS_LOGIT_BIAS,
        MAX_ABS_LOGIT_BIAS,
        each=True,
    ),
    MaxEntries(
        "sampling_params.bad_words_token_ids",
        "sampling.bad_words",
        MAX_TOKEN_LIST,
        per_api_entry=2,
    ),
    BAD_WORD_TOKENS,
    STRUCTURED_SPEC,
    Range(
        "sampling_params.logprobs",
        "output.logprobs",
        0,
        MAX_LOGPROBS,
        api_text=f"at most {MAX_LOGPROBS}",
    ),
    Range(
        "sampling_params.prompt_logprobs",
        "output.prompt_logprobs",
        0,
        MAX_LOGPROBS,
        api_text=f"at most {MAX_LOGPROBS}",
    ),
    Range(
        "sampling_params.repetition_detection.max_pattern_size",
        "stopping.repetition_detection.max_pattern_size",
        1,
        MAX_REPETITION_PATTERN_SIZE,
    ),
    Range(
        "sampling_params.repetition_detection.min_count",
        "stopping.repetition_detection.min_count",
        2,
        MAX_REPETITION_COUNT,
    ),
)

# Derived on the gateway's side: the prompt is checked once truncated (truncate_prompt_tokens
# keeps the last N), a bad word's ids once it is tokenized.
PROMPT_IN_VOCABULARY = InVocabulary("prompt_token_ids", "token_ids.ids", derived=True)
BAD_WORDS_IN_VOCABULARY = InVocabulary(
    "sampling_params.bad_words_token_ids", "sampling.bad_words", each=True, derived=True
)
# Every field of token ids.
VOCABULARY: tuple[InVocabulary, ...] = (
    PROMPT_IN_VOCABULARY,
    InVocabulary("output_token_ids", None),  # a resumed stream's: generated by another engine
    InVocabulary("sampling_params.stop_token_ids", "stopping.stop_token_ids"),
    InVocabulary("sampling_params.eos_token_ids", None),  # the model's
    InVocabulary("sampling_params.allowed_token_ids", "sampling.allowed_token_ids"),
    InVocabulary("sampling_params.logit_bias", "sampling.logit_bias"),
    BAD_WORDS_IN_VOCABULARY,
)
