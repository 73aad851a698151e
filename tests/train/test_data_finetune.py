"""Fine-tuning rows: prompt/completion, chat messages and input_ids + labels.

The references are code nobody here wrote: transformers' ``apply_chat_template`` (its rendering,
its token ids and its ``{% generation %}`` assistant mask) for chat rows, and
``LlamaForCausalLM`` + ``torch.optim.AdamW`` for training, with the loss masked the same way
and divided by the step's number of target tokens.

The test tokenizer is a WordLevel ``tokenizer.json`` with ChatML's special tokens; its
template puts ``<s>`` (id 1) before every text, ``</s>`` (id 2) is EOS::

    <s><|im_start|>system\\nyou are helpful<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n
    <|im_start|>assistant\\nfour .<|im_end|>\\n                 <- loss on "four . <|im_end|>"
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from flowtrain.data.source import load_sequences
from flowtrain.data.text import load_chat_template
from flowtrain.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")

from test_train_vs_hf import (
    ROWS,
    SEQ,
    STEPS,
    assert_same_weights,
    make_checkpoint,
    run_flowtrain,
)

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ("system user assistant you are helpful what is two plus three four five it the answer hi "
         "hello thanks bye ok sure , . ? !").split()
VOCAB = len(SPECIAL) + len(WORDS)  # 31, fits the parity models' 64

# ChatML as Qwen2.5 writes it (a default system turn), plus a BOS and {% generation %} marks
# so that transformers can return its own assistant mask to compare with.
CHATML = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nyou are helpful<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)



@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))

# --- helpers -----------------------------------------------------------------------------


def make_tokenizer(folder: Path, chat_template: str | None = CHATML) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with ``chat_template``) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(SPECIAL)} | {w: i + len(SPECIAL) for i, w in enumerate(WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def ids(text: str) -> list[int]:
    return [len(SPECIAL) + WORDS.index(w) for w in text.split()]


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def shifted(labels: list[int], seq_len: int) -> list[int]:
    """Targets from labels aligned with the ids, as transformers' causal LM loss shifts them."""
    labels = labels[:seq_len] + [-100] * (seq_len - len(labels[:seq_len]))
    return labels[1:] + [-100]


CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two ?"}, {"role": "assistant", "content": "four ."},
     {"role": "user", "content": "thanks"}, {"role": "assistant", "content": "ok bye !"}],
    [{"role": "system", "content": "you are the answer"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello ! what is it ?"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi", "tool_calls": None},
     {"role": "user", "content": "bye"}],  # ends on a user turn: it carries no loss
]


# --- prompt / completion ------------------------------------------------------------------


def test_prompt_completion_learns_the_completion_and_eos_only(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    rows = [{"prompt": "what is two plus two ?", "completion": "four ."},
            {"prompt": "hi", "completion": "hello"}]
    seqs = load_sequences(write_jsonl(tmp_path / "d.jsonl", rows), seq_len=10, vocab_size=VOCAB,
                          tokenizer_dir=model, packing=False)
    first = [1, *ids("what is two plus two ?"), *ids("four ."), 2]  # <s> prompt completion </s>
    assert seqs.input_ids[0].tolist() == first  # 10 tokens: exactly seq_len
    assert seqs.targets[0].tolist() == [-100] * 6 + ids("four .") + [2, -100]
    second = [1, *ids("hi"), *ids("hello"), 2]
    assert seqs.input_ids[1].tolist() == second + [0] * 6
    assert seqs.targets[1].tolist() == [-100, *ids("hello"), 2] + [-100] * 7
    assert seqs.num_targets() == 3 + 2
    cut = load_sequences(tmp_path / "d.jsonl", seq_len=9, vocab_size=VOCAB, tokenizer_dir=model, packing=False)
    assert cut.input_ids[0].tolist() == first[:9]  # cut keeping the start: the EOS goes
    assert cut.targets[0].tolist() == [-100] * 6 + ids("four .") + [-100]


def test_prompt_tokens_never_become_targets(tmp_path):
    """However seq_len cuts, every target is a completion token or the EOS, never a prompt's."""
    model = make_tokenizer(tmp_path / "model")
    rows = [{"prompt": "two two two", "completion": "three three"}, {"prompt": "five", "completion": ""}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    for seq_len in range(3, 9):  # at 2 neither row has a completion token left
        seqs = load_sequences(path, seq_len=seq_len, vocab_size=VOCAB, tokenizer_dir=model)
        real = seqs.targets[seqs.targets != -100]
        assert set(real.tolist()) <= {*ids("three"), 2}, seq_len
    # the second row is <s> five </s>: only the EOS is learnt
    assert seqs.targets[1].tolist()[:3] == [-100, 2, -100]


def test_a_prompt_longer_than_seq_len_leaves_nothing_to_learn(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "two two two two", "completion": "four"},
                                             {"prompt": "hi", "completion": "hello"}])
    seqs = load_sequences(path, seq_len=4, vocab_size=VOCAB, tokenizer_dir=model)
    assert len(seqs) == 1 and seqs.input_ids[0].tolist() == [1, *ids("hi hello"), 2]
    alone = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "two two two two", "completion": "four"}])
    with pytest.raises(DataError, match="no usable sequences.*no token with a loss"):
        load_sequences(alone, seq_len=4, vocab_size=VOCAB, tokenizer_dir=model)


# --- messages against transformers -------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["two-turns", "system", "ends-on-user"])
def test_messages_match_transformers_rendering_ids_and_assistant_mask(tmp_path, conversation):
    model = make_tokenizer(tmp_path / "model")
    hf = transformers.AutoTokenizer.from_pretrained(model)
    text = hf.apply_chat_template(conversation, tokenize=False)
    assert load_chat_template(model).render(conversation) == text
    out = hf.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    want_ids, mask = out["input_ids"], out["assistant_masks"]
    assert sum(mask) > 0 or conversation[-1]["role"] == "user"

    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": conversation}] * 2)
    seqs = load_sequences(path, seq_len=40, vocab_size=VOCAB, tokenizer_dir=model, packing=False)
    assert seqs.input_ids[0, : len(want_ids)].tolist() == want_ids
    labels = [t if m else -100 for t, m in zip(want_ids, mask)]
    assert seqs.targets[0].tolist() == shifted(labels, 40)


def test_rendering_matches_transformers_filters_and_globals(tmp_path):
    """tojson as transformers defines it (no HTML escaping, non-ASCII kept), loop controls,
    strftime_now and the special tokens as variables; a list of named templates picks default."""
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
                "{{ bos_token }}{{ m | tojson }}{{ eos_token }}{% endfor %}"
                "{{ strftime_now('%Y') | length }}{{ pad_token }}{{ unk_token }}")
    model = make_tokenizer(tmp_path / "model", chat_template=template)
    conversation = [{"role": "system", "content": "skip me"},
                    {"role": "user", "content": "a <b> & 'c' é ü"}, {"role": "assistant", "content": "ok"}]
    hf = transformers.AutoTokenizer.from_pretrained(model)
    want = hf.apply_chat_template(conversation, tokenize=False)
    assert '"a <b> & \'c\' é ü"' in want and want.endswith("4<pad><unk>")
    assert load_chat_template(model).render(conversation) == want
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "no"},
                               {"name": "default", "template": template}]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(model).render(conversation) == want


def test_messages_learn_each_assistant_turn_and_its_end_of_turn(tmp_path):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS[0]}])
    seqs = load_sequences(path, seq_len=40, vocab_size=VOCAB, tokenizer_dir=model)
    real = seqs.targets[0][seqs.targets[0] != -100].tolist()
    assert real == [*ids("four ."), 5, *ids("ok bye !"), 5]  # 5 is <|im_end|>


def test_chat_template_jinja_file_wins_and_raise_exception_names_the_line(tmp_path):
    model = make_tokenizer(tmp_path / "model", chat_template="{{ raise_exception('unused') }}")
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('system messages are not supported') }}{% endif %}"
              "{{ m['role'] + ' ' + m['content'] + ' ' }}{% endfor %}")
    (model / "chat_template.jinja").write_text(strict)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS[0]},
                                              {"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError, match=r"line 2: the chat template .*chat_template\.jinja.* "
                                        r"system messages are not supported"):
        load_sequences(path, seq_len=40, vocab_size=VOCAB, tokenizer_dir=model)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    # The first word depends on how long the conversation is: no prefix holds.
    counting = "{{ 'two' if messages | length > 2 else 'four' }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    model = make_tokenizer(tmp_path / "model", chat_template=counting)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match=r"line 1: the chat template does not render this conversation "
                                        r"turn by turn"):
        load_sequences(path, seq_len=40, vocab_size=VOCAB, tokenizer_dir=model)


def test_messages_without_a_chat_template_are_refused_naming_the_file(tmp_path):
    model = make_tokenizer(tmp_path / "model", chat_template=None)
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(DataError, match="has no chat template") as info:
        load_sequences(path, seq_len=40, vocab_size=VOCAB, tokenizer_dir=model)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(DataError, match="has no chat template"):  # a preset: bytes, no template
        load_sequences(path, seq_len=40, vocab_size=256)


# --- input_ids + labels -------------------------------------------------------------------


def test_input_ids_with_labels_are_shifted_like_transformers(tmp_path):
    from transformers.loss.loss_utils import ForCausalLMLoss

    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]},
            {"input_ids": [1, 2, 3], "labels": [-100, 9, -100]},  # a label need not be its id
            {"input_ids": [4, 4], "labels": [4, 4]}]
    seqs = load_sequences(write_jsonl(tmp_path / "d.jsonl", rows), seq_len=6, vocab_size=10, packing=False)
    assert seqs.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 0, 0, 0], [4, 4, 0, 0, 0, 0]]
    assert seqs.targets.tolist() == [shifted(r["labels"], 6) for r in rows]
    labels = torch.tensor([r["labels"] + [-100] * (6 - len(r["labels"])) for r in rows])
    logits = torch.randn(3, 6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    hf = ForCausalLMLoss(logits, labels, 10)
    ours = F.cross_entropy(logits.flatten(0, 1), seqs.targets.flatten(), reduction="sum") / seqs.num_targets()
    torch.testing.assert_close(ours, hf.to(ours.dtype))


def test_labels_rows_and_plain_id_rows_may_share_a_file(tmp_path):
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3], "labels": [-100, -100, 3]}]
    seqs = load_sequences(write_jsonl(tmp_path / "d.jsonl", rows), seq_len=3, vocab_size=10)
    assert seqs.targets.tolist() == [[2, 3, -100], [-100, 3, -100]]


# --- refusals -----------------------------------------------------------------------------


BAD_ROWS = [
    ("prompt without completion", [{"prompt": "hi", "completion": "hello"}, {"prompt": "hi"}],
     r"line 2 has prompt, which is none of the accepted row forms.*\"completion\""),
    ("completion without prompt", [{"completion": "hello"}], r"line 1 has completion, which is none"),
    ("unknown key mix", [{"messages": CONVERSATIONS[0], "prompt": "hi"}],
     r"line 1 has messages, prompt, which is none of the accepted"),
    ("labels without input_ids", [{"labels": [1, 2]}], r"line 1 has labels, which is none"),
    ("unknown key", [{"input_ids": [1, 2], "label": [1, 2]}], r"line 1 has input_ids, label, which"),
    ("labels length", [{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}],
     r"line 2: \"labels\" has 2 entries but \"input_ids\" has 3"),
    ("label out of range", [{"input_ids": [1, 2], "labels": [1, 300]}],
     r"line 1: label 300 at position 1 is neither -100 nor inside"),
    ("labels not ints", [{"input_ids": [1, 2], "labels": [1, "a"]}], r"line 1: \"labels\" must be a flat list"),
    ("prompt not a string", [{"prompt": ["hi"], "completion": "hello"}], r"line 1: \"prompt\" is a list"),
    ("messages not a list", [{"messages": "hi"}], r"line 1: \"messages\" must be a non-empty list"),
    ("message without role", [{"messages": [{"content": "hi"}]}], r"line 1: \"messages\" must be"),
    ("mixed forms", [{"prompt": "hi", "completion": "hello"}, {"text": "hi"}, {"messages": CONVERSATIONS[0]}],
     r"mixes \"prompt/completion\" rows \(line 1\) and \"text\" rows \(line 2\)"),
    ("text mixed with ids", [{"text": "hi"}, {"input_ids": [1, 2], "labels": [1, 2]}],
     r"mixes \"text\" rows \(line 1\) and \"input_ids\" rows \(line 2\)"),
]


@pytest.mark.parametrize("rows, pattern", [c[1:] for c in BAD_ROWS], ids=[c[0] for c in BAD_ROWS])
def test_bad_rows_are_refused_in_one_line_with_their_line_number(tmp_path, rows, pattern):
    model = make_tokenizer(tmp_path / "model")
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=pattern) as info:
        load_sequences(path, seq_len=8, vocab_size=VOCAB, tokenizer_dir=model)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


# --- which tokenizer ----------------------------------------------------------------------


@pytest.mark.parametrize("name, content", [
    ("d.txt", "hello there"),
    ("d.jsonl", '{"text": "hello there"}\n'),
    ("d.jsonl", '{"prompt": "hello", "completion": "there"}\n'),
])
def test_text_with_a_model_folder_but_no_tokenizer_is_refused_unless_bytes_are_asked_for(
    tmp_path, name, content
):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=r"model folder .* has no tokenizer\.json.*--tokenizer DIR"
                                        r".*--byte-tokenizer") as info:
        load_sequences(path, seq_len=8, vocab_size=256, tokenizer_dir=model)
    assert "\n" not in str(info.value)
    on_bytes = load_sequences(path, seq_len=8, vocab_size=256, tokenizer_dir=model, byte_tokenizer=True)
    preset = load_sequences(path, seq_len=8, vocab_size=256)  # no folder: bytes, as ever
    assert torch.equal(on_bytes.input_ids, preset.input_ids)
    assert on_bytes.input_ids[0].tolist()[:5] == list(b"hello")


def test_a_flowtrain_checkpoint_without_tokenizer_goes_on_in_bytes(tmp_path):
    """flowtrain copies tokenizer files into every checkpoint: one without was trained on bytes
    (a preset), so resuming it, or training on from it, needs no flag."""
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"format": "flowtrain-checkpoint", "version": 1}))
    path = tmp_path / "d.txt"
    path.write_text("hello there")
    seqs = load_sequences(path, seq_len=8, vocab_size=256, tokenizer_dir=ckpt)
    assert seqs.input_ids[0].tolist() == list(b"hello th")
    (ckpt / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DataError, match="has no tokenizer.json"):
        load_sequences(path, seq_len=8, vocab_size=256, tokenizer_dir=ckpt)


def test_bytes_for_prompt_completion_end_with_the_models_eos(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "c"}])
    seqs = load_sequences(path, seq_len=5, vocab_size=300, eos_id=257)
    assert seqs.input_ids.tolist() == [[97, 98, 99, 257, 0]]
    assert seqs.targets.tolist() == [[-100, 99, 257, -100, -100]]


def test_ids_need_no_tokenizer_and_bytes_with_a_tokenizer_is_a_config_error(tmp_path):
    empty = tmp_path / "model"
    empty.mkdir()
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    assert len(load_sequences(path, seq_len=4, vocab_size=10, tokenizer_dir=empty)) == 1
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}])
    with pytest.raises(ConfigError, match="byte_tokenizer .* has a tokenizer.json"):  # the field, as the API has it
        load_sequences(text, seq_len=4, vocab_size=VOCAB, tokenizer_dir=make_tokenizer(tmp_path / "tok"),
                       byte_tokenizer=True)


# --- training against transformers + torch.optim.AdamW ------------------------------------


def reference_train(model, rows, *, lr=0.01, wd=0.1, betas=(0.9, 0.95), eps=1e-6, micro=2):
    """AdamW on (input_ids, labels) rows, labels shifted as transformers does; the loss of a step
    is the CE sum over its micro-batches divided by the step's number of target tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas, eps=eps)
    for s in range(STEPS):
        batch = rows[s * ROWS:(s + 1) * ROWS]
        ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
        labels = torch.full((ROWS, SEQ), -100, dtype=torch.long)
        for i, (r, lab) in enumerate(batch):
            ids[i, :len(r[:SEQ])] = torch.tensor(r[:SEQ])
            labels[i, :len(lab[:SEQ])] = torch.tensor(lab[:SEQ])
        targets = torch.cat([labels[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
        n = int((targets != -100).sum())
        opt.zero_grad()
        for m in range(0, ROWS, micro):
            logits = model(input_ids=ids[m:m + micro]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), targets[m:m + micro].flatten(), reduction="sum") / n
            loss.backward()
        opt.step()
    return model


def prompt_completion_rows(gen: torch.Generator) -> list[dict]:
    def words(n: int) -> str:
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=gen))

    return [{"prompt": words(int(torch.randint(1, 7, (1,), generator=gen))),
             "completion": words(int(torch.randint(1, 11, (1,), generator=gen)))}
            for _ in range(ROWS * STEPS)]


def test_prompt_completion_training_matches_hf(tmp_path):
    make_checkpoint(tmp_path / "model")
    make_tokenizer(tmp_path / "model")
    rows = prompt_completion_rows(torch.Generator().manual_seed(7))
    write_jsonl(tmp_path / "d.jsonl", rows)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    pairs = []
    for r in rows:  # the reference's own tokenization: <s> prompt, then completion </s>
        prompt = hf(r["prompt"])["input_ids"]
        completion = hf(r["completion"], add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
        pairs.append((prompt + completion, [-100] * len(prompt) + completion))
    assert any(len(p[0]) > SEQ for p in pairs) and any(len(p[0]) < SEQ for p in pairs)
    ref = reference_train(make_checkpoint(tmp_path / "ref"), pairs)
    run_flowtrain(tmp_path / "model", tmp_path / "d.jsonl", tmp_path / "out", "--no-packing")
    assert_same_weights(tmp_path / "out", ref)


def test_input_ids_with_labels_training_matches_hf(tmp_path):
    make_checkpoint(tmp_path / "model")
    gen = torch.Generator().manual_seed(8)
    pairs, rows = [], []
    for _ in range(ROWS * STEPS):
        n = int(torch.randint(3, SEQ + 5, (1,), generator=gen))
        row = torch.randint(0, 64, (n,), generator=gen).tolist()
        keep = torch.rand(n, generator=gen) < 0.5
        keep[1] = True  # at least one target within seq_len
        labels = [t if k else -100 for t, k in zip(row, keep.tolist())]
        pairs.append((row, labels))
        rows.append({"input_ids": row, "labels": labels})
    write_jsonl(tmp_path / "d.jsonl", rows)
    ref = reference_train(make_checkpoint(tmp_path / "ref"), pairs)
    run_flowtrain(tmp_path / "model", tmp_path / "d.jsonl", tmp_path / "out", "--no-packing")
    assert_same_weights(tmp_path / "out", ref)
