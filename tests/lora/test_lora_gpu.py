"""Multi-LoRA on a GPU: Triton kernels, the LoRA decode CUDA graphs (static layout), async
scheduling and multi-step decode give the tokens of transformers + PEFT (float32 model, so the
comparison is exact up to summation order)."""
from __future__ import annotations

import pytest

from slipstream import LLM, LoRARequest, SamplingParams
from tests.helpers import greedy_ids, load_hf_model
from tests.lora.peft_adapters import make_adapter, peft_model

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 17, 99, 250, 3, 41, 77], [1, 300, 12, 5, 480, 66, 9, 130, 201, 11, 7, 390]]
TARGETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"], ["gate_proj", "down_proj"]]


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_gpu_lora_matches_peft(tiny_llama_dir, tmp_path, decode_steps: int) -> None:
    loras, want = [None], {None: greedy_ids(load_hf_model(tiny_llama_dir), PROMPTS, 8)}
    for i, targets in enumerate(TARGETS):
        path = make_adapter(tiny_llama_dir, tmp_path / f"a{i}", targets, 8, seed=i)
        lora = LoRARequest(f"a{i}", i + 1, str(path))
        loras.append(lora)
        want[lora] = greedy_ids(peft_model(tiny_llama_dir, path), PROMPTS, 8)
    llm = LLM(str(tiny_llama_dir), device="cuda", dtype="float32", enable_lora=True,
              max_loras=2, max_lora_rank=8, decode_steps=decode_steps, max_num_seqs=16,
              kv_cache_memory=1 << 24)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    jobs = [(lo, p) for lo in loras for p in range(len(PROMPTS))]
    outs = llm.generate([PROMPTS[p] for _, p in jobs], params, use_tqdm=False,
                        lora_request=[lo for lo, _ in jobs])
    assert [o.outputs[0].token_ids for o in outs] == [want[lo][p] for lo, p in jobs]
    alone = llm.generate([PROMPTS[0]], params, use_tqdm=False, lora_request=loras[2])
    assert alone[0].outputs[0].token_ids == want[loras[2]][0]
    assert llm.engine.scheduler.lora_slots.num_pinned == 0
