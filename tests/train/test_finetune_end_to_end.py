"""A new user's fine-tune, end to end on the CPU: a tiny Hugging Face Qwen3 checkpoint in bf16
with a real tokenizer and a chat template, a jsonl of conversations, the command line with its
fine-tuning defaults, a bf16 sharded output that transformers reloads and generates from."""

from __future__ import annotations

import json

import pytest
import torch
from test_data_finetune import CONVERSATIONS, VOCAB, make_tokenizer, write_jsonl

from flowtrain.cli import main

transformers = pytest.importorskip("transformers")


def make_qwen3(folder):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    transformers.GenerationConfig(max_new_tokens=4, eos_token_id=2, pad_token_id=0).save_pretrained(folder)
    make_tokenizer(folder)
    return model


def test_chat_fine_tune_of_a_qwen3_checkpoint_reloads_in_bf16_and_generates(tmp_path, capsys):
    assert VOCAB <= 64
    make_qwen3(tmp_path / "qwen3")
    capsys.readouterr()
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS] * 4)
    out = tmp_path / "tuned"
    args = ["train", "--model", str(tmp_path / "qwen3"), "--data", str(data), "--steps", "6", "--batch-size", "4",
            "--micro-batch-size", "2", "--seq-len", "48", "--device", "cpu", "--no-progress", "--out", str(out),
            "--lr", "1e-3", "--metrics", str(tmp_path / "m.jsonl")]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in text and "cosine after 1 warm-up steps" in text
    assert (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
    assert json.loads((out / "config.json").read_text()).get("dtype", json.loads(
        (out / "config.json").read_text()).get("torch_dtype")) == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(model.parameters()).dtype == torch.bfloat16
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template(CONVERSATIONS[0][:1], add_generation_prompt=True, return_tensors="pt")
    ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape[1] > ids.shape[1]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


def test_sharded_bf16_output_on_request(tmp_path):
    make_qwen3(tmp_path / "qwen3")
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "what is two plus three", "completion": "five"}] * 8)
    from flowtrain.train.run import TrainConfig, train

    train(TrainConfig(model=str(tmp_path / "qwen3"), data=str(data), steps=2, batch_size=4, micro_batch_size=2,
                      seq_len=16, device="cpu", progress=False, out=str(tmp_path / "fp32"), save_dtype="fp32"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fp32" / "model.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.float32


def test_text_with_a_tokenizerless_model_folder_is_one_line(tmp_path, capsys):
    from test_train_vs_hf import make_checkpoint

    make_checkpoint(tmp_path / "model", vocab=256)
    capsys.readouterr()
    argv = ["train", "--model", str(tmp_path / "model"), "--steps", "1", "--batch-size", "2", "--micro-batch-size",
            "1", "--seq-len", "16", "--device", "cpu", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tokenizer" in err[0] and "--byte-tokenizer" in err[0]
    assert main([*argv, "--byte-tokenizer"]) == 0
    assert main([*argv, "--byte-tokenizer", "--tokenizer", str(tmp_path)]) == 2
