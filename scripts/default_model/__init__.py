"""Building blocks of scripts/train_default_model.py and scripts/eval_default_model.py.

corpus (stdlib files, held-out list), tokenizer (BPE + chat template), trainer (the loop),
evaluate (perplexity, ast quality check, draft agreement), card (model card), pipeline (all).
"""
