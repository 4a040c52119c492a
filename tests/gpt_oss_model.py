"""A tiny random gpt-oss whose tokenizer speaks harmony, for the tests that serve or decode one
(test_gpt_oss_server.py, determinism/test_contract_gpt_oss.py): transformers' own classes, 2 layers (one sliding,
one full), 4 experts, the embedded model's BPE with harmony's marks added as special tokens and gpt-oss's chat
template (tests/data, as llama.cpp ships it). Its sinks and biases are spread away from their initial zeros so
that each of them changes the tokens."""
from __future__ import annotations

from pathlib import Path

import torch

MARKS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
TEMPLATE = Path(__file__).parent / "data" / "gpt-oss-chat-template.jinja"


def tiny_harmony_model(folder: Path) -> Path:
    import transformers as tf

    from margingate.models.loader import resolve_model_dir

    tok = tf.AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m")))
    tok.add_special_tokens({"additional_special_tokens": MARKS})
    tok.eos_token = "<|return|>"  # as gpt-oss's tokenizer: a grammar that ends ends with it
    tok.chat_template = TEMPLATE.read_text()
    ends = [tok.convert_tokens_to_ids(m) for m in ("<|return|>", "<|call|>")]
    config = tf.GptOssConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=16, max_position_embeddings=4096,
                             eos_token_id=ends)
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                torch.nn.init.normal_(p, std=1.0 if name.endswith("sinks") else 0.1)
            elif not name.endswith("norm.weight"):
                p.mul_(4)  # sharper logits than N(0, 0.02) gives
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
