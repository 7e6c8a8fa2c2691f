"""What `quantization=` accepts: a method name, or (as other engines take it) the checkpoint
format of a pre-quantized checkpoint, which must then be the checkpoint's."""
from __future__ import annotations

import json

import pytest

from slipstream.engine.args import EngineArgs
from slipstream.quantization.base import get_quant_method_factory
from tests.helpers import make_tiny_checkpoint


def _with_config(path, quant_config: dict | None):
    config = json.loads((path / "config.json").read_text())
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (path / "config.json").write_text(json.dumps(config))
    return path


def _method(path, quantization: str | None) -> str | None:
    return EngineArgs(model=str(path), quantization=quantization).create_engine_config().quant.method


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": True}
MODELOPT = {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"]}


@pytest.mark.parametrize(("stored", "requested", "method"), [
    (GPTQ, "gptq", "int4_awq"), (GPTQ, "GPTQ", "int4_awq"), (GPTQ, None, "int4_awq"),
    (MODELOPT, "modelopt", "fp8"), (MODELOPT, "fp8", "fp8"), (None, "fp8", "fp8"),
    (None, None, None)])
def test_format_names_resolve_to_the_loading_method(tmp_path, stored, requested, method) -> None:
    path = _with_config(make_tiny_checkpoint(tmp_path, "LlamaForCausalLM"), stored)
    assert _method(path, requested) == method


@pytest.mark.parametrize(("stored", "requested", "message"), [
    (None, "gptq", "names a checkpoint format, but this checkpoint is not pre-quantized"),
    (GPTQ, "awq", "names a checkpoint format, but this checkpoint is stored as 'gptq'"),
    (GPTQ, "fp8", "already quantized with 'int4_awq'")])
def test_format_name_of_another_checkpoint_is_an_error(tmp_path, stored, requested,
                                                       message) -> None:
    path = _with_config(make_tiny_checkpoint(tmp_path, "LlamaForCausalLM"), stored)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(path), quantization=requested).create_engine_config()
        get_quant_method_factory(requested, json.loads((path / "config.json").read_text()))


def test_unknown_method_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown quantization method 'int3'; choose one of "
                                         r"fp8, int4_awq, int8_wo, w8a8_sq \(or, for a "
                                         r"pre-quantized checkpoint, its format: awq, gptq"):
        get_quant_method_factory("int3")
