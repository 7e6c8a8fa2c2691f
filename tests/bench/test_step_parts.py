"""slipstream.bench.step_parts (benchmarks/bench_step_parts.py) on the CPU (eager, no graph):
every part is timed on a tiny model, a part's patch replaces the layer's forward while active,
and the class patches are restored afterwards (the full forward runs the real attention and
norms again)."""
from __future__ import annotations

import json

import torch

from slipstream.bench import step_parts as bench
from slipstream.layers.attention import Attention
from slipstream.layers.norm import RMSNorm
from tests.helpers import make_tiny_checkpoint


def test_parts_take_their_kernels_out_and_restore(tmp_path, monkeypatch):
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    calls = {"attention": 0, "norm": 0}
    attention, norm = Attention.forward, RMSNorm.forward

    def counting_attention(self, *args, **kwargs):
        calls["attention"] += 1
        return attention(self, *args, **kwargs)

    def counting_norm(self, *args, **kwargs):
        calls["norm"] += 1
        return norm(self, *args, **kwargs)

    monkeypatch.setattr(Attention, "forward", counting_attention)
    monkeypatch.setattr(RMSNorm, "forward", counting_norm)
    with bench.without("no_attention_norms"):
        assert Attention.forward is bench._skip_attention and RMSNorm.forward is bench._skip_norm
    assert Attention.forward is counting_attention and RMSNorm.forward is counting_norm
    out = tmp_path / "parts.json"
    monkeypatch.setattr("sys.argv", ["bench_step_parts.py", "--model", str(path), "--device",
                                     "cpu", "--ctx", "20", "--max-model-len", "32",
                                     "--replays", "1", "--output-json", str(out)])
    with torch.inference_mode():
        bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert [r["part"] for r in rows] == list(bench.PARTS)
    assert all(r["us_per_step"] > 0 for r in rows)
    assert calls["attention"] > 0 and calls["norm"] > 0  # the full forward ran them


def test_projection_parts_skip_the_product_and_restore(tmp_path):
    """no_o: every o_proj launches nothing (outputs of the right shape, the residual add
    dropped) while active; afterwards the layer computes again."""
    from slipstream.engine.args import EngineArgs
    from slipstream.models.loader import load_model

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    model = load_model(EngineArgs(model=str(path), device="cpu",
                                  dtype="float32").create_engine_config())
    o = model.model.layers[0].self_attn.o_proj
    x, residual = torch.ones(1, o.input_size), torch.full((1, o.output_size), 3.0)
    want = o(x) + residual
    with bench.without("no_o", model):
        assert torch.equal(o.forward_residual(x, residual), residual)
        assert o(x).shape == (1, o.output_size)
        assert bench.part_bytes(model, "no_o") == sum(
            layer.self_attn.o_proj.weight.numel() * 4 for layer in model.model.layers)
    assert torch.equal(o.forward_residual(x, residual), want)
    assert not any(a.startswith("forward") for a in vars(o))
    with bench.without("no_head", model):
        assert model.compute_logits(torch.ones(2, o.output_size)).shape[0] == 2
    assert "compute_logits" not in vars(model)
