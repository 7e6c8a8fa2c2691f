"""Multi-LoRA through the engine on the CPU: greedy tokens equal to transformers + PEFT with each
adapter applied, for several target sets and ranks; a batch mixing adapters and the base model
equal to each request alone; slot pressure, chunked prefill, preemption and prefix caching."""
from __future__ import annotations

import pytest

from slipstream import LLM, LoRARequest, SamplingParams
from tests.helpers import greedy_ids, load_hf_model
from tests.lora.peft_adapters import make_adapter, peft_model

MAX_NEW = 6
# (target modules, rank, lora_alpha, rsLoRA)
ADAPTERS = [
    (["q_proj", "v_proj"], 8, 16, False),
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, True),
    (["o_proj", "gate_proj", "down_proj"], 16, 32, False),
    (["k_proj", "up_proj"], 2, 4, False),
]
PROMPTS = [[1, 17, 99, 250, 3, 41, 77], [1, 300, 12, 5, 480, 66, 9, 130, 201, 11, 7, 390,
                                          18, 44, 2, 123, 321, 60, 19, 88]]


@pytest.fixture(scope="module")
def setup(tiny_llama_dir, tmp_path_factory):
    """Base checkpoint, four adapters, and the reference tokens: [adapter or None][prompt]."""
    root = tmp_path_factory.mktemp("loras")
    loras, want = [], {None: greedy_ids(load_hf_model(tiny_llama_dir), PROMPTS, MAX_NEW)}
    for i, (targets, r, alpha, rslora) in enumerate(ADAPTERS):
        path = make_adapter(tiny_llama_dir, root / f"a{i}", targets, r, alpha, rslora, seed=i)
        lora = LoRARequest(f"a{i}", i + 1, str(path))
        loras.append(lora)
        want[lora] = greedy_ids(peft_model(tiny_llama_dir, path), PROMPTS, MAX_NEW)
    return tiny_llama_dir, loras, want


@pytest.fixture(scope="module")
def llm(setup):
    """Two slots for four adapters (slot pressure), small steps (chunked prefill) and a small
    cache (preemption)."""
    return LLM(str(setup[0]), device="cpu", enable_lora=True, max_loras=2, max_lora_rank=16,
               max_cpu_loras=2, max_num_tokens=24, kv_cache_memory=24 * 2048, block_size=4)


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_equals_peft_and_each_alone(setup, llm) -> None:
    _, loras, want = setup
    jobs = [(lora, p) for lora in [None, *loras] for p in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[p] for _, p in jobs], GREEDY, use_tqdm=False,
                        lora_request=[lora for lora, _ in jobs])
    expected = [want[lora][p] for lora, p in jobs]
    assert _ids(outs) == expected
    alone = [_ids(llm.generate([PROMPTS[p]], GREEDY, use_tqdm=False, lora_request=lora))[0]
             for lora, p in jobs[:4]]
    assert alone == expected[:4]
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0  # the small cache preempted, and outputs still match
    sched = llm.engine.scheduler
    assert sched.lora_slots.num_pinned == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
    lora = llm.engine.runner.lora
    assert lora.num_slot_loads > 2 and len(lora._host) <= 2  # paged through 2 slots, 2 on host


def test_prefix_cache_is_per_adapter(setup, llm) -> None:
    _, loras, want = setup
    prompt = PROMPTS[1]
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=loras[0])[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=loras[0])[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=loras[1])[0]
    assert again.num_cached_tokens > 0  # same adapter: the prompt's blocks are reused
    assert other.num_cached_tokens == 0  # another adapter: never the first one's K/V
    assert [first.outputs[0].token_ids, again.outputs[0].token_ids, other.outputs[0].token_ids] \
        == [want[loras[0]][1], want[loras[0]][1], want[loras[1]][1]]


def test_multi_step_decode_path(setup) -> None:
    """decode_steps > 1 runs decodes through the static layout (the CUDA graphs' on a GPU)."""
    base, loras, want = setup
    llm = LLM(str(base), device="cpu", enable_lora=True, max_loras=4, max_lora_rank=16,
              decode_steps=4, kv_cache_memory=1 << 22)
    outs = llm.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False,
                        lora_request=[loras[2], None, loras[3]])
    assert _ids(outs) == [want[loras[2]][0], want[None][0], want[loras[3]][0]]
    # Another mix of the same batch size: the staged layout is rebuilt, not reused.
    outs = llm.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False,
                        lora_request=[loras[3], loras[2], None])
    assert _ids(outs) == [want[loras[3]][0], want[loras[2]][0], want[None][0]]


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(setup, llm, tmp_path) -> None:
    import json
    import shutil

    base, loras, want = setup
    good = loras[0].lora_path
    cases = {}
    cases["missing"] = (tmp_path / "nowhere", "no such directory")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(f"{good}/adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"x")
    cases["pickled"] = (pickled, "adapter_model.bin is a pickle")
    big = tmp_path / "big"
    shutil.copytree(loras[2].lora_path, big)
    cfg = json.loads((big / "adapter_config.json").read_text())
    (big / "adapter_config.json").write_text(json.dumps({**cfg, "r": 32}))
    cases["rank"] = (big, "rank 32 is above max_lora_rank=16")
    wrong = tmp_path / "wrong"
    shutil.copytree(good, wrong)
    (wrong / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    cases["shape"] = (wrong, "do not fit the model")
    embed = tmp_path / "embed"
    shutil.copytree(good, embed)
    (embed / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["embed_tokens"]}))
    cases["target"] = (embed, "embed_tokens")
    for i, (path, message) in enumerate(cases.values()):
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(f"bad{i}", 100 + i, str(path)))
    out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=loras[0])
    assert _ids(out) == [want[loras[0]][0]]
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(base), device="cpu", kv_cache_memory=1 << 20).generate(
            [PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=loras[0])


def test_quantized_base_with_bf16_style_adapters(setup) -> None:
    """int8 weight-only base weights, adapters kept in the model dtype: the tokens of the float
    model with the adapter (int8's rounding is far below what moves these greedy tokens)."""
    import torch

    base, loras, want = setup
    llm = LLM(str(base), device="cpu", quantization="int8_wo", enable_lora=True, max_loras=2,
              max_lora_rank=16, kv_cache_memory=1 << 22)
    jobs = [loras[1], None, loras[2]]
    outs = llm.generate([PROMPTS[0]] * 3, GREEDY, use_tqdm=False, lora_request=jobs)
    assert _ids(outs) == [want[lo][0] for lo in jobs]
    layer = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.int8 and layer.lora.a.dtype == torch.float32
