"""`speculative_config` in vLLM's form: a dict (or its JSON text) naming the proposer.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}
    {"method": "quantized_self_draft", "num_speculative_tokens": 4, "quantization": "rtn"}

Parsed and checked once, at engine start: an unknown field, an unknown method or a bad
value raises ValueError naming the field. Checks that need a model (the draft's
vocabulary against the target's) happen where the draft is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

_DEFAULT_PROMPT_LOOKUP = {"prompt_lookup_max": 4, "prompt_lookup_min": 1}
# The optional fields each method reads; setting one for another method is refused.
METHOD_FIELDS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("model",),
    "quantized_self_draft": ("quantization", "bits", "group_size", "calib_data", "num_layers"),
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    # The most draft tokens per request per step; the scheduler may use fewer.
    num_speculative_tokens: int
    # ngram: the longest and the shortest suffix looked up in the request's tokens.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: an HF directory or .gguf file sharing the target's vocabulary.
    model: str | None = None
    # quantized_self_draft: the target's own weights quantized in memory at start
    # (spec_decode/self_draft.py): "rtn" or "gptq" (which calibrates on `calib_data`, a
    # .txt / .jsonl file or the built-in "calib" corpus), `bits` per code (default 4) and
    # input columns per scale (default: the largest of 128, 64, 32 dividing every layer).
    quantization: str | None = None
    bits: int | None = None
    group_size: int | None = None
    calib_data: str | None = None
    # quantized_self_draft: the draft's depth, the target's first `num_layers` decoder layers
    # and then its final norm and LM head (early exit); None: every layer.
    num_layers: int | None = None
    # Choose k per step from the acceptance rate and the batch's load (spec_decode/adaptive.py);
    # False: always num_speculative_tokens (cut to the budget and the request's limits).
    adaptive: bool = True

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """The config of `value` (a dict, its JSON text, or None: speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config.{unknown[0]}: unknown field; "
                             f"fields are {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config.{name} is required")
        values = dict(value)
        if values["method"] == "ngram":
            for name, default in _DEFAULT_PROMPT_LOOKUP.items():
                values.setdefault(name, default)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        from pagoda.spec_decode.proposer import PROPOSERS

        if self.method not in PROPOSERS:
            raise ValueError(f"speculative_config.method must be one of {sorted(PROPOSERS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        for method, names in METHOD_FIELDS.items():
            for name in names:
                if method != self.method and getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method {method}, "
                                     f"not {self.method}")
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"speculative_config.adaptive must be true or false, "
                            f"got {self.adaptive!r}")
        PROPOSERS[self.method].validate_config(self)
