"""Held-out perplexity of the default model with its (tied) head fake-quantized (an untied copy;
everything else float): int4 round-to-nearest in groups of 128 and 64, and int8 per row."""
import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))
import eval_quant_ppl as E  # noqa: E402

from slipstream.quantization import utils as qu  # noqa: E402

src = REPO / "slipstream/assets/default_model"
_, tok = E.evaluate.load_checkpoint(str(src), torch.device("cpu"))
windows, _ = E.select_windows(tok, 512, 48)
res = {}
nll, n = E.engine_nll(str(src), None, windows)
res["float"] = math.exp(nll / n)
sd = load_file(str(src / "model.safetensors"))
emb = sd["model.embed_tokens.weight"]
for name in ["int4_g128", "int4_g64", "int8_row"]:
    out = Path(f"/tmp/head_{name}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    if name.startswith("int4"):
        q, s, z = qu.quantize_int4_groupwise(emb.float(), int(name.split("g")[1]))
        w = qu.dequantize_int4_groupwise(q, s, z, torch.float32)
    else:
        q, s = qu.quantize_int8_per_channel(emb.float())
        w = q.float() * s.float().reshape(-1, 1)
    save_file({**sd, "lm_head.weight": w.to(emb.dtype).contiguous()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    nll, n = E.engine_nll(str(out), None, windows)
    res[name] = math.exp(nll / n)
    print(name, res[name], f"{100 * (res[name] / res['float'] - 1):+.2f}%", flush=True)
print(json.dumps(res, indent=1))
