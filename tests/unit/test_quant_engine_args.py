"""--quantization / --gguf-native in EngineArgs: parsed from the CLI, validated by name."""

from __future__ import annotations

import argparse

import pytest

from pagoda.config import EngineArgs


def test_flags_reach_the_model_config():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "int8_wo",
                                                       "--gguf-native", "on"]))
    config = args.create_engine_config()
    assert (config.model.quantization, config.model.gguf_native) == ("int8_wo", "on")
    defaults = EngineArgs().create_engine_config().model
    assert (defaults.quantization, defaults.gguf_native) == (None, "auto")


def test_unknown_names_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"quantization must be one of \[.*'gptq'.*\], "
                                         r"got 'int3'"):
        EngineArgs(quantization="int3").create_engine_config()
    with pytest.raises(ValueError, match="gguf_native must be one of"):
        EngineArgs(gguf_native="maybe").create_engine_config()
