"""Chat rows as transformers reads them: the assistant mask of a template with ``{% generation %}``
marks, and rows with ``tools``.

The reference is transformers' own ``apply_chat_template``: its rendering (with ``tools=``) and
the ``assistant_masks`` it returns with ``return_assistant_tokens_mask=True``. The tokenizer is a
byte-level BPE trained here, on the rendered conversations themselves (no network), so its
tokens cross word and newline boundaries the way a real model's do: some of them straddle the
edge of a generation block, which is where a mask computed another way would differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from flowtrain.data.source import load_sequences
from flowtrain.data.text import load_chat_template

transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML with generation marks around an assistant reply and its <|im_end|>, but not the newline
# after it, as Hugging Face's examples of {% generation %} put them; the header stays outside.
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2.5's template, as its tokenizer_config.json ships it (one string per line of it, long lines
# in adjacent pieces): tools in the system turn, tool calls in <tool_call> tags, consecutive
# tool results in one user turn.
QWEN = "\n".join([
    '{%- if tools %}',
    "    {{- '<|im_start|>system\\n' }}",
    "    {%- if messages[0]['role'] == 'system' %}",
    "        {{- messages[0]['content'] }}",
    '    {%- else %}',
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}",
    '    {%- endif %}',
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions'
        ' to assist with the user query.\\n\\nYou are provided with function'
        ' signatures within <tools></tools> XML tags:\\n<tools>" }}',
    '    {%- for tool in tools %}',
    '        {{- "\\n" }}',
    '        {{- tool | tojson }}',
    '    {%- endfor %}',
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json'
        ' object with function name and arguments within <tool_call></tool_call>'
        ' XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\":'
        ' <args-json-object>}\\n</tool_call><|im_end|>\\n" }}',
    '{%- else %}',
    "    {%- if messages[0]['role'] == 'system' %}",
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}",
    '    {%- else %}',
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba"
        " Cloud. You are a helpful assistant.<|im_end|>\\n' }}",
    '    {%- endif %}',
    '{%- endif %}',
    '{%- for message in messages %}',
    '    {%- if (message.role == "user") or (message.role == "system"'
        ' and not loop.first) or (message.role == "assistant" and not'
        ' message.tool_calls) %}',
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    '    {%- elif message.role == "assistant" %}',
    "        {{- '<|im_start|>' + message.role }}",
    '        {%- if message.content %}',
    "            {{- '\\n' + message.content }}",
    '        {%- endif %}',
    '        {%- for tool_call in message.tool_calls %}',
    '            {%- if tool_call.function is defined %}',
    '                {%- set tool_call = tool_call.function %}',
    '            {%- endif %}',
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}",
    '            {{- tool_call.name }}',
    "            {{- '\", \"arguments\": ' }}",
    '            {{- tool_call.arguments | tojson }}',
    "            {{- '}\\n</tool_call>' }}",
    '        {%- endfor %}',
    "        {{- '<|im_end|>\\n' }}",
    '    {%- elif message.role == "tool" %}',
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}',
    "            {{- '<|im_start|>user' }}",
    '        {%- endif %}',
    "        {{- '\\n<tool_response>\\n' }}",
    '        {{- message.content }}',
    "        {{- '\\n</tool_response>' }}",
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}',
    "            {{- '<|im_end|>\\n' }}",
    '        {%- endif %}',
    '    {%- endif %}',
    '{%- endfor %}',
    '{%- if add_generation_prompt %}',
    "    {{- '<|im_start|>assistant\\n' }}",
    '{%- endif %}',
]) + "\n"

# The same with generation marks around everything an assistant turn writes after its header.
QWEN_GENERATION = QWEN.replace(
    """        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}""",
    """        {{- '<|im_start|>' + message.role }}
        {% generation %}
        {%- if message.content %}""").replace(
    """        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}""",
    """        {{- '<|im_end|>\\n' }}
        {% endgeneration %}
    {%- elif message.role == "tool" %}""")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "its name"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

CHATS = [
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "Thanks!\n\n"}, {"role": "assistant", "content": "\n\nYou are welcome, bye!"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!\nHow can I help?"}],
]

TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris and Rome, and the time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "name": "get_weather", "content": "sunny, 21 C"},
    {"role": "tool", "name": "get_weather", "content": "cloudy, 17 C"},
    {"role": "assistant", "content": "Let me check the time too.", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "name": "get_time", "content": "14:05"},
    {"role": "assistant", "content": "Paris: sunny, 21 C, 14:05. Rome: cloudy, 17 C."},
]


@pytest.fixture(autouse=True)
def _data_cache(tmp_path, monkeypatch):
    """Every test builds its data caches in its own folder, not the user's."""
    monkeypatch.setenv("FLOWTRAIN_CACHE", str(tmp_path / "cache"))


def make_bpe_tokenizer(folder: Path, template: str, corpus: list[str]) -> Path:
    """A byte-level BPE (Qwen's pre-tokenizer and offsets) trained on ``corpus``, saved with
    ``template`` as transformers saves a tokenizer: tokenizer.json + tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": template}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def rendered_corpus() -> list[str]:
    """Text with every word the tests' conversations and tools render, to train the BPE on."""
    plain = load_chat_template_from(QWEN)
    return [plain.render(c) for c in CHATS] + [plain.render(TOOL_CHAT, tools=[WEATHER, TIME])] * 3


def load_chat_template_from(template: str):
    from flowtrain.data.text import ChatTemplate

    return ChatTemplate("test", template, {})


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def learnt_labels(seqs, row: int = 0) -> list[int]:
    """Row ``row``'s labels as transformers aligns them (position t: the token t, or -100), from
    flowtrain's targets (position t: the label of t + 1); position 0 is never a target."""
    targets = seqs.targets[row].tolist()
    return [-100] + targets[:-1]


def hf_labels(hf, messages, tools=None) -> tuple[list[int], list[int]]:
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    return ids, [t if m else -100 for t, m in zip(ids, mask)]


def straddles(hf, messages, tools=None) -> bool:
    """Whether some token of the conversation crosses the edge of a generation block (so that a
    mask drawn at token boundaries by any other rule would differ from transformers')."""
    text, spans = load_chat_template_from(hf.chat_template).render_spans(messages, tools)
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    edges = [e for span in spans for e in span]
    return any(start < edge < end for start, end in offsets for edge in edges)


# --- generation marks ----------------------------------------------------------------------


def test_generation_marks_train_exactly_what_transformers_masks(tmp_path):
    model = make_bpe_tokenizer(tmp_path / "model", CHATML_GENERATION, rendered_corpus())
    hf = transformers.AutoTokenizer.from_pretrained(model)
    assert any(straddles(hf, c) for c in CHATS), "the conversations should put a token across a block's edge"
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    seqs = load_sequences(path, seq_len=256, vocab_size=len(hf), tokenizer_dir=model,
                          packing=False)
    assert seqs.report.mask == "generation"
    for row, chat in enumerate(CHATS):
        ids, labels = hf_labels(hf, chat)
        assert seqs.input_ids[row, : len(ids)].tolist() == ids
        assert learnt_labels(seqs, row)[: len(ids)] == labels, chat
        assert all(t == -100 for t in seqs.targets[row, len(ids) - 1:].tolist())
        # the newline after <|im_end|> lies outside the marks: transformers does not learn it
        # (turn by turn, the rule for templates without marks, would)
        assert hf.convert_tokens_to_ids("<|im_end|>") in [t for t in labels if t != -100]


def test_a_template_without_marks_keeps_the_turn_by_turn_rule(tmp_path):
    unmarked = CHATML_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    model = make_bpe_tokenizer(tmp_path / "model", unmarked, rendered_corpus())
    hf = transformers.AutoTokenizer.from_pretrained(model)
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[1]}])
    seqs = load_sequences(path, seq_len=256, vocab_size=len(hf), tokenizer_dir=model)
    assert seqs.report.mask == "turns"
    learnt = hf.decode([t for t in seqs.targets[0].tolist() if t != -100])
    assert learnt == "Hello!\nHow can I help?<|im_end|>\n"  # the reply and its whole end of turn


# --- tools ---------------------------------------------------------------------------------


@pytest.mark.parametrize("template", [QWEN, QWEN_GENERATION], ids=["qwen", "qwen-generation-marks"])
def test_tools_render_as_transformers_renders_them(tmp_path, template):
    model = make_bpe_tokenizer(tmp_path / "model", template, rendered_corpus())
    hf = transformers.AutoTokenizer.from_pretrained(model)
    tools = [WEATHER, TIME]
    want = hf.apply_chat_template(TOOL_CHAT, tools=tools, tokenize=False)
    assert '"name": "get_weather", "description": "The weather in a city, now."' in want
    assert load_chat_template(model).render(TOOL_CHAT, tools=tools) == want
    assert load_chat_template(model).render(TOOL_CHAT) == hf.apply_chat_template(TOOL_CHAT, tokenize=False)


def test_tool_calls_are_learnt_and_tool_results_are_not(tmp_path):
    model = make_bpe_tokenizer(tmp_path / "model", QWEN, rendered_corpus())
    hf = transformers.AutoTokenizer.from_pretrained(model)
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": [WEATHER, TIME]}])
    seqs = load_sequences(path, seq_len=512, vocab_size=len(hf), tokenizer_dir=model)
    want = hf.apply_chat_template(TOOL_CHAT, tools=[WEATHER, TIME], tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert seqs.input_ids[0, : len(want)].tolist() == list(want)
    learnt = hf.decode([t for t in seqs.targets[0].tolist() if t != -100])
    assert learnt == (  # from after each assistant header (the generation prompt) through <|im_end|>\\n
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        'Let me check the time too.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n'
        '</tool_call><|im_end|>\nParis: sunny, 21 C, 14:05. Rome: cloudy, 17 C.<|im_end|>\n')
    assert "sunny" not in learnt.split("Paris:")[0]  # the tool results are context, not targets


def test_tool_turns_under_generation_marks_match_transformers_mask(tmp_path):
    model = make_bpe_tokenizer(tmp_path / "model", QWEN_GENERATION, rendered_corpus())
    hf = transformers.AutoTokenizer.from_pretrained(model)
    path = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": [WEATHER, TIME]}])
    seqs = load_sequences(path, seq_len=512, vocab_size=len(hf), tokenizer_dir=model)
    ids, labels = hf_labels(hf, TOOL_CHAT, tools=[WEATHER, TIME])
    assert sum(t != -100 for t in labels) > 40
    assert seqs.input_ids[0, : len(ids)].tolist() == ids
    assert learnt_labels(seqs)[: len(ids)] == labels


def test_tools_must_be_a_list_of_objects(tmp_path):
    from flowtrain.errors import DataError

    model = make_bpe_tokenizer(tmp_path / "model", QWEN, rendered_corpus())
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[1], "tools": None},
                                                {"messages": CHATS[1], "tools": "get_weather"}])
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: \"tools\" must be a list of objects") as info:
        load_sequences(path, seq_len=256, vocab_size=1000, tokenizer_dir=model)
    assert "\n" not in str(info.value)


def test_assistant_mask_follows_transformers_walk_for_spans_out_of_order():
    """Spans in the order their blocks finished need not be sorted (a block inside a block):
    the mask then walks them as transformers' loop does, not by a sorted search."""
    from flowtrain.data.text import assistant_mask

    offsets = np.array([[0, 2], [2, 4], [4, 6], [6, 8], [8, 10]])
    spans = [(6, 10), (0, 4)]  # e.g. a block in a macro whose text is written after a later block
    walked = [False] * 5
    k = 0
    for t, (start, end) in enumerate(offsets.tolist()):  # transformers' loop, written out
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        walked[t] = end > spans[k][0]
    assert assistant_mask(offsets, spans).tolist() == walked == [False, False, False, True, True]
    assert assistant_mask(offsets, [(3, 5)]).tolist() == [False, True, True, False, False]  # straddling tokens
    assert assistant_mask(offsets, []).tolist() == [False] * 5
