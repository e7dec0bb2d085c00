"""speculative_config parsing (vLLM's form; a bad config refused naming the field) and the
ngram proposer."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from pagoda.config import EngineArgs
from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.ngram import NgramProposer, ngram_propose
from pagoda.spec_decode.proposer import ProposerContext
from pagoda.worker.input_batch import InputBatch

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}

SELF_DRAFT = {"method": "quantized_self_draft", "num_speculative_tokens": 4}


def test_vllm_form_from_dict_json_and_cli() -> None:
    config = SpeculativeConfig.parse(NGRAM)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max,
            config.prompt_lookup_min, config.adaptive) == ("ngram", 4, 4, 2, True)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}') == (
        SpeculativeConfig("ngram", 2, prompt_lookup_max=4, prompt_lookup_min=1))
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    text = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = parser.parse_args(["--speculative-config", text])
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    assert engine_config.speculative.num_speculative_tokens == 3
    assert EngineArgs().create_engine_config().speculative is None
    gptq = SpeculativeConfig.parse({**SELF_DRAFT, "quantization": "gptq", "bits": 8,
                                    "group_size": -1, "calib_data": "calib"})
    assert (gptq.quantization, gptq.bits, gptq.group_size, gptq.calib_data) == (
        "gptq", 8, -1, "calib")
    assert SpeculativeConfig.parse(SELF_DRAFT).quantization is None  # rtn, 4 bits, auto group


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "medusa", "num_speculative_tokens": 4}, "speculative_config.method"),
    ({"num_speculative_tokens": 4}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({**NGRAM, "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({**NGRAM, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({**NGRAM, "prompt_lookup_min": 5}, "speculative_config.prompt_lookup_min"),
    ({**NGRAM, "lookahead": 5}, "speculative_config.lookahead"),
    ({**NGRAM, "model": "x"}, "speculative_config.model"),
    ("{not json", "speculative_config"),
    ({**NGRAM, "quantization": "rtn"}, "speculative_config.quantization"),
    ({**SELF_DRAFT, "quantization": "awq"}, "speculative_config.quantization"),
    ({**SELF_DRAFT, "bits": 3}, "speculative_config.bits"),
    ({**SELF_DRAFT, "bits": True}, "speculative_config.bits"),
    ({**SELF_DRAFT, "group_size": 0}, "speculative_config.group_size"),
    ({**SELF_DRAFT, "quantization": "gptq"}, "speculative_config.calib_data"),
    ({**SELF_DRAFT, "calib_data": "calib"}, "speculative_config.calib_data"),
    ({**SELF_DRAFT, "model": "x"}, "speculative_config.model"),
    ({**SELF_DRAFT, "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
])
def test_bad_config_refused_naming_the_field(value, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(speculative_config=value).create_engine_config()


@pytest.mark.parametrize(("history", "expected"), [
    ([1, 2, 3, 4, 5, 1, 2, 3], [4, 5, 1]),     # longest suffix [1, 2, 3] -> 4 5 1
    ([9, 1, 2, 7, 1, 2, 8, 2], [7, 1, 2]),     # only n = 1 matches: its earliest hit
    ([1, 2, 3, 9], []),                        # nothing repeats
    ([7, 7], [7]),                             # one token after the match
    ([5], []),
])
def test_ngram_lookup(history: list[int], expected: list[int]) -> None:
    assert ngram_propose(torch.tensor(history), 3, 3, 1) == expected


def test_ngram_min_length_is_respected() -> None:
    assert ngram_propose(torch.tensor([9, 1, 2, 7, 1, 2, 8, 2]), 3, 3, 2) == []
    assert ngram_propose(torch.tensor([9, 1, 2, 7, 1, 2]), 3, 3, 2) == [7, 1, 2]


def test_ngram_proposer_reads_each_slot_history() -> None:
    batch = InputBatch(4, 32, 4)
    params = None
    batch.add_request("a", [1, 2, 3, 1, 2], 5, [[]], params, False)
    batch.add_request("b", [4, 5, 6], 3, [[]], params, False)
    context = ProposerContext(100, torch.device("cpu"), torch.float32, 32, 4, 16)
    proposer = NgramProposer(SpeculativeConfig.parse(NGRAM), context)
    assert proposer.propose(batch, np.array([0, 1]), 4) == [[3, 1, 2], []]
