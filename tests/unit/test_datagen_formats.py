"""Training data in every common layout: ShareGPT, role/content lists under "conversations" or
"messages", plain prompt lists (strings, {"prompt"}, {"text"}), as JSON or JSONL, normalized
by one function (outrider/conversations.py read_conversations) for `drafter datagen --user-file` and for
`read_samples` (train --data). A record it cannot read is named: file, line or record, the
accepted shapes."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from outrider.conversations import ACCEPTED, read_conversations
from outrider.loaders.tokenizer import Tokenizer
from outrider.train.datagen import generate_dataset, read_user_file
from outrider.train.dataset import conversation_sample, read_samples

SYSTEM = {"role": "system", "content": "Be brief."}
HI, HELLO = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
BYE, CIAO = {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}
CHAT = [SYSTEM, HI, HELLO, BYE, CIAO]


def jsonl(*records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# (name, file text, [(id, messages)]) -- one per layout
FORMATS = [
    (
        "sharegpt.jsonl",
        jsonl({"id": "a1", "conversations": [
            {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye"},
            {"from": "gpt", "value": "Ciao"},
        ]}),
        [("a1", CHAT)],
    ),
    (
        "sharegpt.json",  # a JSON list, pretty-printed, ids by record number
        json.dumps([
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
            {"conversations": [{"from": "human", "value": "Bye"}]},
        ], indent=2),
        [("1", [HI, HELLO]), ("2", [BYE])],
    ),
    (
        "specforge.jsonl",  # role/content under "conversations"
        jsonl({"id": 7, "conversations": CHAT}),
        [("7", CHAT)],
    ),
    (
        "openai.jsonl",  # "messages", content as a string or as text parts
        jsonl({"messages": [SYSTEM, {"role": "user", "content": [
            {"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}, HELLO]}),
        [("1", [SYSTEM, {"role": "user", "content": "Hi\nthere"}, HELLO])],
    ),
    ("prompts.json", json.dumps(["Hi", "Bye"]), [("1", [HI]), ("2", [BYE])]),
    ("prompts.jsonl", jsonl("Hi", "Bye"), [("1", [HI]), ("2", [BYE])]),
    ("prompt.jsonl", jsonl({"prompt": "Hi"}, {"prompt": "Bye", "id": "b"}), [("1", [HI]), ("b", [BYE])]),
    ("text.jsonl", jsonl({"text": "Hi"}), [("1", [HI])]),
    ("one.json", json.dumps({"messages": [HI, HELLO]}, indent=2), [("1", [HI, HELLO])]),
]  # fmt: skip


@pytest.mark.parametrize("name,text,want", FORMATS, ids=[f[0] for f in FORMATS])
def test_each_layout_normalizes(tmp_path, name, text, want):
    path = tmp_path / name
    path.write_text(text)
    got = read_conversations(path)
    assert [(c.id, list(c.messages)) for c in got] == want
    # datagen keeps the user turns and the system message; answers are regenerated.
    jobs = read_user_file(path)
    assert [(j.id, j.turns, j.system) for j in jobs] == [
        (f"user-{i}", [m["content"] for m in msgs if m["role"] == "user"],
         next((m["content"] for m in msgs if m["role"] == "system"), None))
        for i, msgs in want
    ]  # fmt: skip


def test_a_mixed_file_numbers_records_by_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        jsonl("Hi", {"prompt": "Bye"})
        + "\n"  # a blank line: skipped, still counted
        + jsonl(
            {"conversations": [{"from": "human", "value": "Hi"}, {"role": "assistant", "content": "Hello"}]},
            {"messages": [{"role": "USER", "content": "Bye"}]},
            {"text": "Hi", "id": "t"},
        )
    )  # fmt: skip
    got = [(c.id, list(c.messages)) for c in read_conversations(path)]
    assert got == [("1", [HI]), ("2", [BYE]), ("4", [HI, HELLO]), ("5", [BYE]), ("t", [HI])]


def test_jsonl_text_holding_line_separators_and_crlf_line_ends(tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028 and U+0085 raw; str.splitlines breaks there.
    odd = "a\u2028b\x85c\u2029d"
    lines = [json.dumps(r, ensure_ascii=False) for r in (odd, {"prompt": "Bye"}, {"text": odd})]
    path = tmp_path / "odd.jsonl"
    path.write_bytes("\r\n".join(lines).encode() + b"\r\n")
    got = [(c.id, list(c.messages)) for c in read_conversations(path)]
    assert got == [
        ("1", [{"role": "user", "content": odd}]),
        ("2", [BYE]),
        ("3", [{"role": "user", "content": odd}]),
    ]
    assert [j.turns for j in read_user_file(path)] == [[odd], ["Bye"], [odd]]


# (file text, what the error says after the file name); all but a broken JSON list, which is
# not about a record's shape, go on with the accepted shapes.
BAD = [
    (jsonl("Hi", 3), r": line 2: a JSON number is not a record; accepted records: "),
    (jsonl("Hi", None), r": line 2: a JSON null is not a record"),
    (jsonl({"question": "Hi"}), r": line 1: no prompt, text, messages or conversations among its keys \['question'\]"),
    (jsonl({"conversations": "Hi"}), r": line 1: \"conversations\" is a JSON string, not a list of turns"),
    (jsonl({"conversations": [{"from": "human", "value": "Hi"}, {"from": "tool", "value": "x"}]}),
     r": line 1: conversations\[1\] has role 'tool'; roles read: system, human, user, gpt"),
    (jsonl({"messages": [{"content": "Hi"}]}), r": line 1: messages\[0\] has role None"),
    (jsonl({"messages": [{"role": "user", "content": None}]}), r": line 1: messages\[0\] has content None, not a string"),
    (jsonl({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), r": line 1: messages\[0\] has non-text content parts"),
    (jsonl({"messages": ["Hi"]}), r": line 1: messages\[0\] is a JSON string, not a turn object"),
    ('"Hi"\n{"prompt": "Bye"\n', r": line 2 is not valid JSON: fix or delete that line"),
    (json.dumps(["Hi", 4]), r": record 2: a JSON number is not a record"),
    ('[\n  "Hi",\n  "Bye"\n', r" is not valid JSON \(line 4, column 1: .*\): fix it"),
]  # fmt: skip


@pytest.mark.parametrize("text,match", BAD)
def test_a_record_it_cannot_read_is_named(tmp_path, text, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    for read in (read_conversations, read_user_file):
        with pytest.raises(ValueError, match=f"^{str(path)}{match}") as e:
            read(path)
        assert (ACCEPTED in str(e.value)) == (not text.startswith("[\n"))


def test_files_without_user_turns_or_at_all(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl' not found"):
        read_conversations(tmp_path / "nowhere.jsonl")
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        jsonl({"conversations": [{"from": "gpt", "value": "Hello"}]}, {"prompt": " "})
    )
    assert len(read_conversations(answers)) == 2  # readable, but nothing to ask the target
    with pytest.raises(ValueError, match=r"holds no user turns: each record needs a user"):
        read_user_file(answers)


class FakeLLM:
    """A chat template of tags over a one-character-per-token tokenizer; every answer the
    target writes is "ok"."""

    def __init__(self):
        tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(map(chr, ids)))
        self.engine = SimpleNamespace(max_model_len=4096, tokenizer=tok)
        self.prompts: list[str] = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat_text(self, text):
        return [ord(c) for c in text]

    def generate(self, prompts, params):
        self.prompts += ["".join(map(chr, p)) for p in prompts]
        return [SimpleNamespace(token_ids=[ord("o"), ord("k")]) for _ in prompts]


def test_datagen_regenerates_every_answer_of_a_user_file(tmp_path):
    user = tmp_path / "chats.json"
    user.write_text(json.dumps([
        {"id": "s", "conversations": [{"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "FILE ANSWER"},
            {"from": "human", "value": "Bye"}]},
        "Why?",
    ]))  # fmt: skip
    llm, out = FakeLLM(), tmp_path / "data.jsonl"
    generate_dataset(llm, out, num_samples=5, max_new_tokens=2, seed_prompts=False,
                     self_generated=0, user_file=user)  # fmt: skip
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"user-s", "user-2"}
    text = "".join(map(chr, recs["user-s"]["input_ids"]))
    assert text == (
        "<system>Be brief.</system><user>Hi</user><assistant>ok</assistant>"
        "<user>Bye</user><assistant>ok"
    )
    assert "FILE ANSWER" not in "".join(llm.prompts)
    learned = "".join(
        chr(i) for i, m in zip(recs["user-s"]["input_ids"], recs["user-s"]["loss_mask"]) if m
    )
    assert learned == "okok"


def test_datagen_samples_carry_their_conversation_as_text(tmp_path):
    """Each sample's "conversations" is its ids in words: the template over them up to the last
    answer, plus that answer, decodes to exactly input_ids; the file reads back as conversations,
    and training and resumption read old samples without the field beside new ones."""
    user = tmp_path / "chats.jsonl"
    user.write_text(jsonl({"messages": [SYSTEM, HI, HELLO, BYE]}, "Why?"))
    out = tmp_path / "data.jsonl"
    out.write_text(jsonl({"id": "user-1", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}))
    llm = FakeLLM()
    generate_dataset(llm, out, num_samples=5, max_new_tokens=2, seed_prompts=False,
                     self_generated=0, user_file=user)  # fmt: skip
    old, new = map(json.loads, out.read_text().splitlines())
    assert "conversations" not in old and len(llm.prompts) == 1  # user-1 was not redone
    decode = llm.engine.tokenizer.decode
    chat = new["conversations"]
    assert chat == [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "ok"}]
    assert decode(new["input_ids"]) == llm.apply_chat_template(chat[:-1], True) + "ok"
    learned = [i for i, m in zip(new["input_ids"], new["loss_mask"]) if m]
    assert [m["content"] for m in chat if m["role"] == "assistant"] == [decode(learned)]

    samples = read_samples(out, vocab_size=0x110000, chat=llm)
    assert [s.id for s in samples] == ["user-1", "user-2"]
    assert samples[1].input_ids.tolist() == new["input_ids"]

    out.write_text(jsonl(new))  # a new file, resumed: its ids are skipped as before
    assert [(c.id, list(c.messages)) for c in read_conversations(out)] == [("user-2", chat)]
    generate_dataset(llm, out, num_samples=5, max_new_tokens=2, seed_prompts=False,
                     self_generated=0, user_file=user)  # fmt: skip
    done = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in done] == ["user-2", "user-1"] and len(llm.prompts) == 3
    ok = {"role": "assistant", "content": "ok"}
    chat = done[1]["conversations"]
    assert chat == [SYSTEM, HI, ok, BYE, ok]  # the file's answer "Hello" was regenerated
    assert decode(done[1]["input_ids"]) == llm.apply_chat_template(chat[:-1], True) + "ok"


def learned_text(sample, decode) -> str:
    return decode([i for i, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()) if m])


def test_conversations_train_on_their_own_answers(tmp_path):
    """read_samples on a conversation file: the answers are learned (with the end of their
    turn), nothing else; prompt lists have nothing to learn."""
    llm = FakeLLM()
    chats = tmp_path / "sharegpt.jsonl"
    chats.write_text(FORMATS[0][1] + jsonl({"messages": [HELLO, HI, HELLO]}, "Just a prompt"))
    samples = read_samples(chats, vocab_size=0x110000, chat=llm)
    assert [s.id for s in samples] == ["a1", "2"]  # the prompt alone is not a sample
    decode = llm.engine.tokenizer.decode
    assert decode(samples[0].input_ids.tolist()) == llm.apply_chat_template(CHAT, False)
    assert learned_text(samples[0], decode) == "Hello</assistant>Ciao</assistant>"
    # An answer before any question is rendered but not learned.
    assert learned_text(samples[1], decode) == "Hello</assistant>"
    assert decode(samples[1].input_ids.tolist()).startswith("<assistant>Hello</assistant><user>")

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["Hi", "Bye"]))
    with pytest.raises(ValueError, match="holds prompts without answers.*datagen --user-file"):
        read_samples(prompts, chat=llm)
    with pytest.raises(
        ValueError,
        match=r"holds conversations, not token ids: run `outrider drafter datagen --user-file",
    ):
        read_samples(chats)  # no chat template to render them with
    with pytest.raises(
        ValueError, match=r"conversation a1: token id \d+ is outside the target's vocabulary of 100"
    ):
        read_samples(chats, vocab_size=100, chat=llm)  # 'y' is 121
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl({"conversations": [HI, HELLO]}, {"messages": 3}))
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: \"messages\" is a JSON number"):
        read_samples(bad, chat=llm)


class ThinkingLLM(FakeLLM):
    """Drops an earlier answer's reasoning when re-rendering it, as some templates do."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        last = len(messages) - 1
        shown = [
            {**m, "content": m["content"].split("</think>")[-1]}
            if m["role"] == "assistant" and (i < last or add_generation_prompt) else m
            for i, m in enumerate(messages)
        ]  # fmt: skip
        return super().apply_chat_template(shown, add_generation_prompt)


def test_a_template_that_rewrites_earlier_turns_learns_the_last_answer_only():
    llm = ThinkingLLM()
    from outrider.conversations import Conversation

    think = {"role": "assistant", "content": "<think>hm</think>Hello"}
    sample = conversation_sample(Conversation("x", (HI, think, BYE, CIAO)), llm)
    decode = llm.engine.tokenizer.decode
    assert decode(sample.input_ids.tolist()).count("<think>") == 0
    assert learned_text(sample, decode) == "Ciao</assistant>"
    one = conversation_sample(Conversation("y", (HI, think)), llm)
    assert learned_text(one, decode) == "<think>hm</think>Hello</assistant>"
    assert conversation_sample(Conversation("z", (HI,)), llm) is None


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_real_tokenizer_and_chat_template_mask_exactly_the_answers():
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>"]
    words = ["Be brief. Hi Hello Bye Ciao user assistant system"] * 4
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # every byte, newlines included
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet
    )
    backend.train_from_iterator(words, trainer)
    tok = Tokenizer(backend, chat_template=CHATML)
    chat = SimpleNamespace(
        apply_chat_template=lambda m, g=True: tok.apply_chat_template(m, add_generation_prompt=g),
        encode_chat_text=lambda text: tok.encode(text, add_special_tokens=False),
    )
    from outrider.conversations import Conversation

    sample = conversation_sample(Conversation("c", tuple(CHAT)), chat)
    assert sample.input_ids.tolist() == tok.encode(tok.apply_chat_template(CHAT, False), False)
    learned = learned_text(sample, lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert learned == "Hello<|im_end|>\nCiao<|im_end|>\n"
    assert sample.loss_mask.dtype == torch.bool and sample.input_ids.dtype == torch.int32


def test_datagen_samples_read_as_before(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(jsonl({"id": "seed-0", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}))
    (sample,) = read_samples(data, vocab_size=8)
    assert sample.id == "seed-0" and sample.loss_mask.tolist() == [False, True, True]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no samples"):
        read_samples(empty)
    assert Path(data).read_text().count("\n") == 1
