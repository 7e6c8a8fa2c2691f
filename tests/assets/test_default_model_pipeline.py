"""End-to-end check of scripts/train_default_model.py at --tiny scale (CPU, seconds).

The outputs must be ordinary HF checkpoints: transformers loads them, generates, applies the
chat template; the card, the metrics and the archive hold what the issue asks for.
"""

from __future__ import annotations

import json
import tarfile

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

HF_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md")


@pytest.mark.parametrize("name", ["default_model", "draft_model"])
def test_checkpoint_loads_and_generates(tiny_run, name):
    out, _ = tiny_run
    model_dir = out / "models" / name
    for f in HF_FILES:
        assert (model_dir / f).is_file(), f
    with safe_open(str(model_dir / "model.safetensors"), "pt") as st:
        assert {st.get_tensor(k).dtype for k in st.keys()} == {torch.bfloat16}
        assert "lm_head.weight" not in st.keys()  # tied to the embedding
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings and model.config.model_type == "llama"
    enc = tok("def add(a, b):", return_tensors="pt")
    assert enc.input_ids[0, 0].item() == tok.bos_token_id == tok.eos_token_id
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=8, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    assert ids.shape[1] > enc.input_ids.shape[1]
    assert isinstance(tok.decode(ids[0], skip_special_tokens=True), str)


def test_chat_template_and_special_tokens(tiny_run):
    out, _ = tiny_run
    tok = AutoTokenizer.from_pretrained(out / "models" / "default_model")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Add two numbers."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|endoftext|><|system|>\nBe brief.\n<|user|>\nAdd two numbers.\n"
                    "<|assistant|>\n")
    ids = tok(text, add_special_tokens=False).input_ids
    for special in ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"):
        assert tok.convert_tokens_to_ids(special) in ids
    assert tok.pad_token_id not in (None, tok.eos_token_id)


def test_draft_is_smaller_and_shares_the_tokenizer(tiny_run):
    out, metrics = tiny_run
    target, draft = (out / "models" / n for n in ("default_model", "draft_model"))
    assert (target / "tokenizer.json").read_bytes() == (draft / "tokenizer.json").read_bytes()
    assert metrics["draft"]["train"]["params"] * 3 < metrics["target"]["train"]["params"]


def test_metrics_report_what_the_card_needs(tiny_run):
    out, metrics = tiny_run
    on_disk = json.loads((out / "models" / "metrics.json").read_text())
    assert on_disk["target"]["heldout"] == metrics["target"]["heldout"]
    for role in ("target", "draft"):
        train = metrics[role]["train"]
        assert train["steps"] == 20 and train["train_seconds"] > 0
        assert train["final_train_loss"] < 6.3  # ln(512) = 6.24 at random init
        assert train["val_curve"][-1][1] < train["val_curve"][0][1] + 0.05
        assert 1 < metrics[role]["heldout"]["perplexity"] < 512
        quality = metrics[role]["quality"]
        assert quality["num_prompts"] == 4 and 0 <= quality["num_parse"] <= 4
    assert 0 <= metrics["agreement"]["agreement"] <= 1
    assert metrics["corpus"]["heldout_files"][:1] == ["asyncio/locks.py"]
    assert metrics["hardware"]["device"]


def test_model_card_contents(tiny_run):
    out, metrics = tiny_run
    card = (out / "models" / "default_model" / "README.md").read_text()
    for needle in ("Python Software Foundation License", "asyncio/locks.py", "LlamaForCausalLM",
                   f"{metrics['target']['train']['params']:,}", "held-out perplexity",
                   "Final training loss", "parse with `ast`", "Draft agreement", "```python"):
        assert needle in card, needle
    draft_card = (out / "models" / "draft_model" / "README.md").read_text()
    assert "draft" in draft_card.splitlines()[0]


def test_archive_holds_both_models_and_metrics(tiny_run):
    out, _ = tiny_run
    with tarfile.open(out / "models.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"metrics.json", "default_model/model.safetensors", "draft_model/model.safetensors",
            "default_model/README.md", "draft_model/tokenizer_config.json"} <= names


def test_eval_script_reproduces_the_training_metrics(tiny_run):
    import eval_default_model

    out, metrics = tiny_run
    models = out / "models"
    result = eval_default_model.main(
        ["--model", str(models / "default_model"), "--draft", str(models / "draft_model"),
         "--max-files", "3", "--quality-prompts", "4", "--max-new-tokens", "16",
         "--seq-len", "64", "--device", "cpu"])
    for role in ("target", "draft"):
        assert result[role]["heldout"]["perplexity"] == pytest.approx(
            metrics[role]["heldout"]["perplexity"], rel=1e-4)
        assert result[role]["quality"]["num_parse"] == metrics[role]["quality"]["num_parse"]
    assert result["agreement"]["agreement"] == pytest.approx(
        metrics["agreement"]["agreement"], abs=1e-3)
