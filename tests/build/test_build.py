"""`slipstream build` on the CPU: a built engine gives the unbuilt engine's greedy tokens for
every precision and quantization method the CPU runs, loads without quantizing, and refuses
clearly to run where it was not built for."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream import LLM, SamplingParams
from slipstream.build.manifest import EngineMismatchError
from slipstream.cli import main

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [17, 3, 250, 11]}]
LIMITS = dict(kv_cache_memory=8 << 20, max_model_len=96, max_num_seqs=4, max_num_tokens=256)


@pytest.fixture(scope="module")
def source(tiny_checkpoint) -> Path:
    # Tied embeddings: the unquantized engine stores the table once, a quantized head unties it.
    # K = 128 and 256: whole int4 groups.
    return tiny_checkpoint("Qwen3ForCausalLM", hidden_size=128, intermediate_size=256,
                           tie_word_embeddings=True)


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def engines(source, tmp_path_factory):
    """name -> (engine dir, the unbuilt engine's tokens, its start-up phases)."""
    root = tmp_path_factory.mktemp("engines")
    cases = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
             "int8_wo": dict(quantization="int8_wo", quantize_lm_head=True),
             "fp8": dict(quantization="fp8"), "int4_awq": dict(quantization="int4_awq")}
    out = {}
    for name, kwargs in cases.items():
        unbuilt = LLM(str(source), **LIMITS, **kwargs)
        engine = slipstream.build(str(source), root / name, **LIMITS, **kwargs)
        out[name] = (engine, _greedy(unbuilt), unbuilt.engine.startup_phases)
    return out


@pytest.mark.parametrize("name", ["float32", "bfloat16", "int8_wo", "fp8", "int4_awq"])
def test_built_engine_matches_the_unbuilt_one(engines, name) -> None:
    engine, tokens, unbuilt_phases = engines[name]
    llm = LLM(str(engine))
    assert _greedy(llm) == tokens
    cfg = llm.engine_config
    assert cfg.load_format == "engine" and cfg.scheduler.max_model_len == 96
    assert cfg.scheduler.max_num_seqs == 4 and cfg.cache.num_blocks is not None
    phases = llm.engine.startup_phases
    assert set(phases) >= {"read_weights", "quantize", "tune", "profile_memory", "warm_up",
                           "capture_graphs", "total"}
    if name in ("int8_wo", "fp8", "int4_awq"):  # quantized at build time, never at load
        assert unbuilt_phases["quantize"] > 0 and phases["quantize"] == 0


def test_manifest_records_the_build(engines, source) -> None:
    engine = engines["int8_wo"][0]
    manifest = json.loads((engine / "engine.json").read_text())
    assert manifest["environment"]["device"] == "cpu"
    assert manifest["environment"]["torch"] and manifest["environment"]["slipstream"]
    assert manifest["settings"]["quantization"] == "int8_wo"
    assert manifest["settings"]["lm_head"] == "int8_wo"
    assert manifest["limits"] == {"max_model_len": 96, "max_num_seqs": 4, "max_num_tokens": 256}
    assert manifest["memory_plan"]["num_blocks"] == LLM(str(engine)).engine_config.cache.num_blocks
    assert len(manifest["source"]["sha256"]) == 64
    assert manifest["runtime"]["folded_norms"]  # int8_wo folds the norms at build time
    assert not manifest["runtime"]["aliases"]  # the quantized head is no longer tied
    f32 = json.loads((engines["float32"][0] / "engine.json").read_text())
    assert f32["runtime"]["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}


def _edited(engine: Path, tmp_path: Path, **env) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(engine, copy)
    manifest = json.loads((copy / "engine.json").read_text())
    manifest["environment"].update(env)
    (copy / "engine.json").write_text(json.dumps(manifest))
    return copy


def test_another_version_or_device_is_a_clear_error(engines, tmp_path) -> None:
    engine = _edited(engines["float32"][0], tmp_path, torch="1.0.0", device="cuda",
                     gpu_name="NVIDIA H100 80GB HBM3")
    with pytest.raises(EngineMismatchError, match=r"torch: built with '1\.0\.0'.*Rebuild it "
                                                   r"here: slipstream build --model .*--output"):
        LLM(str(engine))


def test_asking_beyond_the_build_is_a_clear_error(engines) -> None:
    engine = engines["int8_wo"][0]
    with pytest.raises(EngineMismatchError, match=r"max_model_len=512 \(built for at most 96\)"):
        LLM(str(engine), max_model_len=512)
    with pytest.raises(EngineMismatchError, match=r"quantization='fp8' \(built with 'int8_wo'\)"):
        LLM(str(engine), quantization="fp8")
    with pytest.raises(EngineMismatchError, match="built for cpu, not cuda"):
        LLM(str(engine), device="cuda")


def test_build_refuses_to_overwrite(engines, source, tmp_path, capsys) -> None:
    other = tmp_path / "not-an-engine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not an engine directory"):
        slipstream.build(str(source), other)
    assert main(["build", "--model", str(source), "--output", str(engines["fp8"][0])]) == 2
    assert "already holds an engine" in capsys.readouterr().err


def test_a_q4_1_gguf_int4_engine_keeps_its_float_zeros(tmp_path) -> None:
    """The default model's form: GGUF Q4_1 blocks on int4_awq, whose float16 zeros (-m) the
    built engine saves and reads back as they are."""
    from tests.models.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path, "Q4_1")
    kwargs = dict(quantization="int4_awq", dtype="float32", **LIMITS)
    tokens = _greedy(LLM(str(path), **kwargs))
    llm = LLM(str(slipstream.build(str(path), tmp_path / "engine", **kwargs)))
    assert _greedy(llm) == tokens
    assert llm.engine.runner.model.model.layers[0].mlp.down_proj.zeros.dtype == torch.float16
