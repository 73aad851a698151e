"""Write a small Qwen3-shaped chat model into a folder, laid out as a Hugging Face download is.

With a real model you skip this script and download one instead, for example
``huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir chat-model``; everything after
that is the same (docs/finetune.md says what differs with a template that has no generation
marks, as most shipped ones). This script exists so that the fine-tuning walk-through in docs/finetune.md runs
offline, in a minute, on a laptop's CPU. Its model is random (it knows nothing yet), small
(2 layers, hidden size 128) and its tokenizer is trained here on the example conversations.

    python docs/examples/make_chat_model.py chat-model

The folder gets what a model folder from the Hub has:

- ``config.json`` + ``model.safetensors``: a ``Qwen3ForCausalLM``, saved by transformers;
- ``tokenizer.json``: a byte-level BPE (the kind Qwen, Llama 3 and GPT-2 use), trained with the
  ``tokenizers`` library on the text of docs/examples/chats.jsonl;
- ``tokenizer_config.json``: which tokens are special, and the chat template (ChatML, as Qwen's,
  with ``{% generation %}`` marks around what the assistant writes);
- ``generation_config.json``: stop at the end of an assistant turn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging

logging.disable_progress_bar()  # no "Writing model shards" bar for a file of 2 MB

EXAMPLES = Path(__file__).resolve().parent

# Qwen's special tokens: the end of a document (also the padding) and the two ChatML brackets.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML: every message is "<|im_start|>ROLE\nCONTENT<|im_end|>\n". The {% generation %} ...
# {% endgeneration %} marks say which text the assistant wrote (its reply and its <|im_end|>):
# transformers' apply_chat_template(..., return_assistant_tokens_mask=True) returns those tokens
# as its assistant mask, and flowtrain trains on exactly them. The add_generation_prompt branch
# opens an assistant turn for the model to complete when it generates.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE as Qwen's: any text maps to tokens (at worst one per byte), frequent
    pieces of words become single tokens, and the special tokens are never split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return tok


def chat_texts(jsonl: Path) -> list[str]:
    """The text of every message in a jsonl of ``{"messages": [...]}`` rows (to train the BPE on)."""
    rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [f"{m['role']}\n{m['content']}" for row in rows for m in row["messages"]]


def main() -> None:
    parser = argparse.ArgumentParser(description="write a small random Qwen3 chat model (config, weights, tokenizer)")
    parser.add_argument("folder", type=Path, help="the model folder to write")
    parser.add_argument("--data", type=Path, default=EXAMPLES / "chats.jsonl", help="conversations to train the tokenizer on")
    args = parser.parse_args()
    folder: Path = args.folder
    folder.mkdir(parents=True, exist_ok=True)

    # The tokenizer: tokenizer.json, and tokenizer_config.json as transformers reads it.
    tok = train_tokenizer(chat_texts(args.data), vocab_size=512)
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,  # Qwen's chat models put no BOS in front; the template writes the rest
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")

    # The model: Qwen3's architecture at a toy size (Qwen3-0.6B has 28 layers of hidden size 1024).
    pad, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    config = Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=im_end, pad_token_id=pad)
    torch.manual_seed(0)  # the same random weights on every run
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)  # config.json + model.safetensors (fp32)
    # Replies end at <|im_end|>; greedy decoding, so the example's replies are reproducible.
    GenerationConfig(eos_token_id=[im_end, pad], pad_token_id=pad, do_sample=False,
                     max_new_tokens=32).save_pretrained(folder)
    print(f"wrote {folder}: Qwen3ForCausalLM, {model.num_parameters():,} parameters, "
          f"a vocabulary of {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
