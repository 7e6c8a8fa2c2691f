"""Draft trees (shapes, masks, accepted paths) and the heads' proposers against direct
computations: Medusa in both published layouts, EAGLE / EAGLE-3 drafts against the head run
densely (no paged cache) over the target's hidden states from transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream import LLM, SamplingParams
from slipstream.kernels.reference import rms_norm
from slipstream.speculative import tree
from slipstream.speculative.medusa import load_medusa
from tests.helpers import load_hf_model
from tests.speculative.heads import medusa_tensors, write_eagle, write_medusa


def test_tree_shapes_masks_and_paths():
    paths = tree.default_tree(depth=3, num_nodes=8, width=3)
    assert paths[0] == (0,) and (0, 0) in paths
    assert len(paths) == 8 and all(p[:-1] in paths for p in paths if len(p) > 1)
    assert [len(p) for p in paths] == sorted(len(p) for p in paths)  # breadth-first
    parents = tree.parents_of([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    assert parents == [-1, -1, 0, 0, 1, 2]
    assert tree.depths(parents) == [1, 1, 2, 2, 2, 3]
    # Row 6 (node 5: root -> 0 -> 2 -> 5) sees chunk tokens 0, 1, 3 and 6.
    assert tree.row_masks(parents)[6] == 0b1001011
    assert tree.prune(parents, 2) == 5
    drafts = [10, 11, 12, 13, 14, 15]
    # Sampled per row (root, nodes 0..5): root -> 11 (node 1), node 1 -> 14 (node 4), node 4
    # samples 99: path [1, 4].
    sampled = [11, 0, 14, 0, 0, 99, 0]
    assert tree.accept_path(drafts, parents, sampled) == [1, 4]
    # Node 1 (chunk 2, position 7) moves to position 6, node 4 (position 10) to 7: the source
    # slot 15 is also a destination, so every source is read before any write.
    assert tree.path_moves([1, 4], 5, [7, 3, 9], 4) == ([15, 38], [14, 15])
    assert tree.first_chain(drafts, parents) == [10, 12, 15]
    with pytest.raises(ValueError, match="breadth-first"):
        tree.check_parents([-1, 0, -1])


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return tiny_checkpoint("LlamaForCausalLM")


def test_medusa_layouts_load_the_same_heads(target, tmp_path):
    faster = load_medusa(write_medusa(tmp_path / "f", target, 2, 2, "faster"), torch.float32, "cpu")
    vllm = load_medusa(write_medusa(tmp_path / "v", target, 2, 2, "vllm"), torch.float32, "cpu")
    blocks, heads = medusa_tensors(target, 2, 2)
    h = torch.randn(3, blocks[0][0][0].shape[0])
    want = []
    for head_blocks, head in zip(blocks, heads):  # x + SiLU(W x + b) per block, then the head
        x = h
        for w, b in head_blocks:
            x = x + F.silu(x @ w.T + b)
        want.append(x @ head.T)
    for model in (faster, vllm):
        for got, ref in zip(model(h, 2), want, strict=True):
            torch.testing.assert_close(got, ref)
    with pytest.raises(ValueError, match="safetensors"):
        (tmp_path / "pt").mkdir()
        (tmp_path / "pt" / "medusa_lm_head.pt").write_bytes(b"x")
        load_medusa(tmp_path / "pt", torch.float32, "cpu")


@pytest.mark.parametrize("eagle3", [False, True])
def test_eagle_drafts_equal_a_dense_run_of_the_head(target, tmp_path, eagle3):
    """The first step's k drafts of one greedy request against the head run without a paged
    cache: causal attention over the prompt's features, then k - 1 steps on its own."""
    head_dir = write_eagle(tmp_path / "h", target, eagle3=eagle3)
    prompt, k = [5, 9, 33, 7, 120, 64, 3], 3
    llm = LLM(
        str(target),
        dtype="float32",
        device="cpu",
        max_model_len=64,
        kv_cache_memory=1 << 20,
        decode_steps=1,
        speculative_config={
            "method": "eagle3" if eagle3 else "eagle",
            "model": str(head_dir),
            "num_speculative_tokens": k,
            "adaptive": False,
        },
    )
    proposer = llm.engine.spec.proposer
    seen = {}
    real_propose = proposer.propose

    def spy(wanted):
        out = real_propose(wanted)
        for r, _ in wanted:
            seen.setdefault(r.request_id, (list(r.all_token_ids), out.get(r.request_id)))
        return out

    proposer.propose = spy
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    tokens, drafts = next(iter(seen.values()))
    assert drafts == _dense_drafts(load_hf_model(target), proposer.head, tokens, k, eagle3)


@torch.no_grad()
def _dense_drafts(hf, head, tokens: list[int], k: int, eagle3: bool) -> list[int]:
    s, w = head.shape, head.w
    out = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    if eagle3:  # HF's hidden_states[i] is the input of layer i
        feats = F.linear(torch.cat([out.hidden_states[i][0] for i in s.aux_layers], -1), w["fc.weight"])
    else:
        feats = out.hidden_states[-1][0]  # after the final norm
    embed = hf.model.embed_tokens.weight
    p = "midlayer." if eagle3 else "layers.0."
    cos_sin = head.rotary.cos_sin_cache
    keys, values = [], []

    def layer(emb, feat, pos):
        if eagle3:
            x = torch.cat(
                [
                    rms_norm(emb, w[p + "input_layernorm.weight"], s.eps),
                    rms_norm(feat, w[p + "hidden_norm.weight"], s.eps),
                ],
                -1,
            )
            residual = feat
        else:
            x = residual = F.linear(torch.cat([emb, feat], -1), w["fc.weight"], w["fc.bias"])
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(-1, s.heads, s.head_dim)
        kk = (x @ w[p + "self_attn.k_proj.weight"].T).view(-1, s.kv_heads, s.head_dim)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, s.kv_heads, s.head_dim)
        q, kk = _rope(q, pos, cos_sin), _rope(kk, pos, cos_sin)
        keys.append(kk)
        values.append(v)
        K = torch.cat(keys).repeat_interleave(s.heads // s.kv_heads, 1)
        V = torch.cat(values).repeat_interleave(s.heads // s.kv_heads, 1)
        n, L = q.shape[0], K.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, K) * s.head_dim**-0.5
        mask = torch.arange(L)[None, :] > (torch.arange(n) + L - n)[:, None]
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, -torch.inf).softmax(-1), V)
        h = residual + attn.reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = rms_norm(h, w[p + "post_attention_layernorm.weight"], s.eps)
        g = F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
        return h + g @ w[p + "mlp.down_proj.weight"].T

    def draft(feat):
        if eagle3:
            ids = F.linear(rms_norm(feat, w["norm.weight"], s.eps), w["lm_head.weight"]).argmax(-1)
            return ids + w["d2t"][ids]
        return hf.lm_head(feat).argmax(-1)

    n = len(tokens) - 1
    h = layer(embed[tokens[1:]], feats, torch.arange(n))[-1:]
    drafts = [int(draft(h))]
    for j in range(1, k):
        h = layer(embed[[drafts[-1]]], h, torch.tensor([n - 1 + j]))
        drafts.append(int(draft(h)))
    return drafts


def _rope(x, pos, cos_sin):
    half = x.shape[-1] // 2
    cs = cos_sin[pos]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


# Depth 1: ranks 0-5; depth 2: ranks 0-3 under the top-1 draft; depth 3: ranks 0-1 under it.
EAGLE_TREE = [[0], [1], [2], [3], [4], [5], [0, 0], [0, 1], [0, 2], [0, 3], [0, 0, 0], [0, 0, 1]]


@pytest.mark.parametrize("eagle3", [False, True])
def test_eagle_tree_is_exact_beats_the_chain_and_keeps_head_kv_right(tiny_checkpoint, tmp_path, eagle3):
    """A 16-token vocabulary, so the next-ranked leaves are often right: the same tokens as
    without speculation, a mean accepted length above the chain's on the same prompts, and
    after every tree step (accepted leaves included) the next drafts' chain equals the head
    run densely over the known tokens, so the head's K/V holds exactly the accepted path."""
    path = tiny_checkpoint("LlamaForCausalLM", vocab_size=16)
    head_dir = write_eagle(tmp_path / "h", path, eagle3=eagle3)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11, 12, 13], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2 + [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    ]
    kw = dict(
        dtype="float32",
        device="cpu",
        max_num_seqs=4,
        max_model_len=64,
        kv_cache_memory=1 << 20,
        decode_steps=1,
    )
    want = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)]
    method = "eagle3" if eagle3 else "eagle"
    mean_len = {}
    for name, tree_choices in (("chain", None), ("tree", EAGLE_TREE)):
        spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": 3, "adaptive": False}
        if tree_choices is not None:
            spec["speculative_token_tree"] = tree_choices
        llm = LLM(str(path), speculative_config=spec, **kw)
        proposer = llm.engine.spec.proposer
        seen = []
        real_propose = proposer.propose

        def spy(wanted, real_propose=real_propose, seen=seen):
            out = real_propose(wanted)
            seen += [(list(r.all_token_ids), out[r.request_id]) for r, _ in wanted if r.request_id in out]
            return out

        proposer.propose = spy
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        stats = llm.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        mean_len[name] = stats["speculative"][method]["mean_accepted_length"]
        if name == "tree":
            hf = load_hf_model(path)
            for tokens, (drafts, parents) in seen[::3]:
                chain = tree.first_chain(drafts, parents)
                assert chain == _dense_drafts(hf, proposer.head, tokens, len(chain), eagle3)
    assert mean_len["tree"] > mean_len["chain"] >= 1.0


def test_eagle_tree_expands_only_the_top_chain():
    from slipstream.speculative.config import SpeculativeConfig

    with pytest.raises(ValueError, match=r"\[0, \.\.\., 0, r\]"):
        SpeculativeConfig.from_dict(
            {
                "method": "eagle",
                "model": "/tmp",
                "num_speculative_tokens": 2,
                "speculative_token_tree": [[0], [1], [1, 0]],
            }
        )
    with pytest.raises(ValueError, match="applies to"):
        SpeculativeConfig.from_dict(
            {"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": [[0]]}
        )


def test_eagle_tree_ranks_within_the_heads_vocabulary(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("LlamaForCausalLM", vocab_size=16)
    head = write_eagle(tmp_path / "h", path, eagle3=True)  # a draft vocabulary of 8
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="rank 8 past the head's 8 tokens"):
        LLM(
            str(path),
            device="cpu",
            max_model_len=64,
            speculative_config=spec | {"speculative_token_tree": [[0], [8]]},
        )
