"""Token ids -> text, incrementally, with stop strings and safe streaming.

Each step decodes only a small window: the tokens since the last complete piece of
text plus a few before them for context (prefix/read offsets). The text of the new
tokens is the window's text minus its prefix's text. A window whose text ends in
U+FFFD is an incomplete UTF-8 sequence (a byte-level token that splits an emoji or CJK
character); it is held back until a later token completes it, so concatenated deltas
equal one full decode of the output ids.

Stop strings are searched only in the newly added text plus the len(stop) - 1
characters before it, so a check costs O(new text), not O(output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagoda.sampling_params import SamplingParams

# Prompt tokens kept as decoding context, so that the first output token keeps its
# leading space in tokenizers that strip it at the start of a text (SentencePiece).
_NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _make_decode(tokenizer: Any, params: SamplingParams) -> Callable[[list[int]], str]:
    """A `list[int] -> str` decoder with `params`' special-token options.

    Fast tokenizers are called through their Rust backend, which is what their
    transformers `decode` runs after microseconds of Python. NOTE: like vLLM, no
    clean_up_tokenization_spaces (it is not stable under windowing), and
    spaces_between_special_tokens only reaches slow tokenizers, as in transformers.
    """
    skip = params.skip_special_tokens
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip)
    spaces = params.spaces_between_special_tokens
    return lambda ids: tokenizer.decode(
        ids,
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
        clean_up_tokenization_spaces=False,
    )


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into `output_text`, step by step.

    Contract: after the last `update`, `output_text` equals
    `tokenizer.decode(output_ids, skip_special_tokens=...)` (without the stop token that
    ended it), truncated at the first stop string (kept when include_stop_str_in_output).
    Stop strings are only matched once more than `min_tokens` tokens have been output.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.params = params
        self.output_text = ""
        self._decode = _make_decode(tokenizer, params)
        self._stops: list[str] = params.stop if params.detokenize else []
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            # NOTE: a prompt that ends inside a character cannot be a text prefix of the
            # output's window; decode the output on its own instead.
            context = []
        self._token_ids = context
        # Window [prefix_offset, read_offset) is already text; ids after it are pending.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._num_output_tokens = 0
        self._num_sent_chars = 0
        self._stopped = False

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append this step's tokens; return the stop string that matched, if any.

        stop_terminated: the last id is the eos/stop token that finished the request;
        its text is not added. After a stop string matched, later calls do nothing.
        """
        if self._stopped:
            return None
        num_ids = len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            self._num_output_tokens += 1
            if stop_terminated and i == num_ids - 1:
                break
            if not self.params.detokenize:
                continue
            stop = self._append(self._decode_next(token_id))
            if stop is not None:
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for the client: the unsent part (delta) or all of it so far.

        While not finished, the last `params.output_text_buffer_length` characters are
        held back so that a stream never shows the start of a stop string that will be
        cut. When finished, an incomplete trailing byte sequence is flushed (as U+FFFD,
        as tokenizer.decode renders it).
        """
        if finished:
            self._flush()
        buffer = 0 if finished else self.params.output_text_buffer_length
        length = len(self.output_text) - buffer
        if not delta:
            return self.output_text[: max(length, 0)]
        if length <= self._num_sent_chars:
            return ""
        text = self.output_text[self._num_sent_chars : length]
        self._num_sent_chars = length
        return text

    def _decode_next(self, token_id: int) -> str:
        """Add one id to the window; return the text it completes ("" while pending)."""
        self._token_ids.append(token_id)
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        return new_text[len(prefix_text) :]

    def _flush(self) -> None:
        """Emit pending ids even though their text is incomplete."""
        if self._stopped or self._read_offset == len(self._token_ids):
            return
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(ids)
        self._append(new_text[len(prefix_text) :])

    def _append(self, text: str) -> str | None:
        """Add `text` to the output and check the stop strings against it."""
        if not text:
            return None
        self.output_text += text
        if not self._stops or self._num_output_tokens <= self.params.min_tokens:
            return None
        return self._check_stop(len(text))

    def _check_stop(self, num_new_chars: int) -> str | None:
        """Find the earliest stop string that ends in the last `num_new_chars` chars;
        truncate the output there and return it."""
        text = self.output_text
        best_index, best_stop = -1, None
        for stop in self._stops:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best_stop is None or index < best_index):
                best_index, best_stop = index, stop
        if best_stop is None:
            return None
        end = best_index + len(best_stop) if self.params.include_stop_str_in_output else best_index
        self.output_text = text[:end]
        self._stopped = True
        return best_stop


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token alone (special tokens included), for Logprob.decoded_token.

    A token that holds part of a multi-byte character decodes to U+FFFD, as in vLLM.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode([token_id], skip_special_tokens=False)
    return tokenizer.decode([token_id], skip_special_tokens=False)
