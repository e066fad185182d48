"""Tokenizer wrapper, demo tokenizer and the ChatML layout with Qwen2.5-VL's media blocks (against the real template,
rendered by Jinja)."""

from __future__ import annotations

import json

import pytest

from dhp.data.demo import QWEN2_5_VL_CHAT_TEMPLATE, QWEN2_5_VL_SPECIAL_TOKENS, build_demo_tokenizer
from dhp.data.tokenizer import IGNORE_INDEX, Tokenizer, TokenizerError, render_chat
from dhp.models.qwen2_5_omni.processor import audio_placeholder, audio_token_ids
from dhp.models.qwen2_5_vl.processor import vision_placeholders, vision_token_ids

TEXTS = ["What digit is this?", "3", "What are the two digits?", "3 7", "Read the digits from left to right.",
         "4 1 9", "How many digits are there?", "2"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_demo_tokenizer(tmp_path_factory.mktemp("tok"), TEXTS))


def _images(tok: Tokenizer, counts: list[int]) -> dict[str, list[list[int]]]:
    """The blocks Qwen2.5-VL's processor gives ``<image>`` tags of ``counts`` tokens each."""
    image, _ = vision_placeholders(tok)
    return {"<image>": [image.block(n) for n in counts]}


def _hf(tok: Tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tok.path / "tokenizer.json"))


def _reference_ids(tok: Tokenizer, messages: list[dict[str, str]], counts: list[int], gen: bool = False) -> list[int]:
    """Qwen's path: the Jinja chat template on content lists, then the processor's <|image_pad|> expansion."""
    structured = []
    for m in messages:
        parts = m["content"].split("<image>")
        content = [{"type": "text", "text": parts[0]}]
        for p in parts[1:]:
            content += [{"type": "image"}, {"type": "text", "text": p}]
        structured.append({"role": m["role"], "content": content})
    hf = _hf(tok)
    text = hf.apply_chat_template(structured, chat_template=QWEN2_5_VL_CHAT_TEMPLATE, tokenize=False,
                                  add_generation_prompt=gen)
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(counts) + 1
    text = pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:], strict=True))
    return hf(text, add_special_tokens=False)["input_ids"]


def test_demo_tokenizer_is_small_deterministic_and_round_trips(tmp_path) -> None:
    a = build_demo_tokenizer(tmp_path / "a", TEXTS)
    b = build_demo_tokenizer(tmp_path / "b", list(reversed(TEXTS)))
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert json.loads((a / "tokenizer_config.json").read_text())["chat_template"] == QWEN2_5_VL_CHAT_TEMPLATE
    tok = Tokenizer(a)
    assert 256 + len(QWEN2_5_VL_SPECIAL_TOKENS) <= tok.vocab_size <= 512
    for text in ["Hello, World! 0123456789 ~{}|\\", "tabs\tand\nnewlines  ", "unicode: é 数字 🙂", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("7 3") == [tok.token_to_id("7"), tok.token_to_id("Ġ"), tok.token_to_id("3")]


def test_special_tokens_by_name_and_single(tok: Tokenizer) -> None:
    ids = {token: tok.token_to_id(token) for token in QWEN2_5_VL_SPECIAL_TOKENS}
    assert None not in ids.values() and len(set(ids.values())) == len(ids)
    for token, tid in ids.items():
        assert tok.encode(token) == [tid]
    assert (tok.im_start_id, tok.im_end_id) == (ids["<|im_start|>"], ids["<|im_end|>"])
    assert tok.encode("<|im_start|>user") == [tok.im_start_id, *tok.encode("user")]
    assert tok.decode([tok.im_start_id, *tok.encode("hi")]) == "hi"
    assert tok.decode([tok.im_start_id, *tok.encode("hi")], skip_special_tokens=False) == "<|im_start|>hi"
    assert vision_token_ids(tok) == {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
                                     "vision_start_token_id": ids["<|vision_start|>"],
                                     "vision_end_token_id": ids["<|vision_end|>"]}


def test_missing_special_token_names_token_and_dir(tmp_path) -> None:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models

    raw = HFTok(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    raw.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
    raw.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"<\|im_end\|>") as e:
        Tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer(tmp_path / "nowhere")
    raw.add_special_tokens(["<|im_end|>"])  # a ChatML tokenizer without the vision tokens: the family names them
    raw.save(str(tmp_path / "tokenizer.json"))
    chatml = Tokenizer(tmp_path)
    assert chatml.has("<|im_start|>", "<|im_end|>") and not chatml.has("<|im_end|>", "<|image_pad|>")
    with pytest.raises(TokenizerError, match=r"special token <\|image_pad\|> or <\|IMAGE\|> is missing .*Qwen2.5-VL"):
        vision_token_ids(chatml)


def test_render_matches_qwen_template_text(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "What digit is this?"}, {"role": "assistant", "content": "3"}]
    hf = _hf(tok)
    ref = hf.apply_chat_template(msgs, chat_template=QWEN2_5_VL_CHAT_TEMPLATE, tokenize=False)
    assert render_chat(msgs) == ref
    assert ref.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    ref2 = hf.apply_chat_template(sys_msgs, chat_template=QWEN2_5_VL_CHAT_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    assert render_chat(sys_msgs, add_generation_prompt=True) == ref2


@pytest.mark.parametrize(
    ("messages", "counts"),
    [
        ([{"role": "user", "content": "<image>\nWhat digit is this?"}, {"role": "assistant", "content": "3"}], [4]),
        ([{"role": "user", "content": "<image><image>What are the two digits?"},
          {"role": "assistant", "content": "3 7"}], [2, 9]),
        ([{"role": "system", "content": "Answer with digits."},
          {"role": "user", "content": "first <image> then"}, {"role": "assistant", "content": "\n\n 4 1 9  "},
          {"role": "user", "content": "How many digits are there?"}, {"role": "assistant", "content": "3"}], [6]),
        ([{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "ok"}], []),
    ],
)
def test_ids_equal_qwen_template_plus_processor(tok: Tokenizer, messages, counts) -> None:
    ids, labels = tok.encode_conversation(messages, _images(tok, counts))
    assert ids == _reference_ids(tok, messages, counts)
    assert tok.conversation_ids(messages, _images(tok, counts)) == ids  # (what validation counts: no labels)
    assert len(labels) == len(ids)
    assert ids.count(vision_token_ids(tok)["image_token_id"]) == sum(counts)
    supervised = [t for t in labels if t != IGNORE_INDEX]
    expected = []
    for m in messages:
        if m["role"] == "assistant":
            expected += tok.encode(m["content"]) + [tok.im_end_id]
    assert supervised == expected


def test_exact_label_layout(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "<image>What digit is this?"}, {"role": "assistant", "content": "3"}]
    ids, labels = tok.encode_conversation(msgs, _images(tok, [2]))
    e, v = tok.encode, vision_token_ids(tok)
    prefix = (
        [tok.im_start_id] + e("system\nYou are a helpful assistant.") + [tok.im_end_id] + e("\n")
        + [tok.im_start_id] + e("user\n") + [v["vision_start_token_id"], v["image_token_id"], v["image_token_id"],
                                             v["vision_end_token_id"]] + e("What digit is this?") + [tok.im_end_id]
        + e("\n") + [tok.im_start_id] + e("assistant\n")
    )
    reply = e("3") + [tok.im_end_id]
    assert ids == prefix + reply + e("\n")
    assert labels == [IGNORE_INDEX] * len(prefix) + reply + [IGNORE_INDEX]


def test_generation_prompt(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "<image>What digit is this?"}]
    ids, labels = tok.encode_conversation(msgs, _images(tok, [3]), add_generation_prompt=True)
    assert ids == _reference_ids(tok, msgs, [3], gen=True)
    assert ids[-len(tok.encode("assistant\n")) - 1:] == [tok.im_start_id, *tok.encode("assistant\n")]
    assert set(labels) == {IGNORE_INDEX}


def test_conversation_errors(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images"):
        tok.encode_conversation([{"role": "user", "content": "<image><image>"}], _images(tok, [4]))
    with pytest.raises(ValueError, match="unknown role 'bot'"):
        tok.encode_conversation([{"role": "bot", "content": "x"}])
    with pytest.raises(ValueError, match="empty conversation"):
        tok.encode_conversation([])


def test_omni_tokenizer_aliases_and_audio_blocks(tmp_path) -> None:
    """A tokenizer with Qwen2.5-Omni's names (<|IMAGE|>, <|vision_bos|>, ...) gives the same attributes, and
    ``<audio>`` expands to <|audio_bos|> + <|AUDIO|> x n + <|audio_eos|>, never supervised."""
    from dhp.data.demo import QWEN2_5_OMNI_CHAT_TEMPLATE

    d = build_demo_tokenizer(tmp_path / "omni", ["What digits were dialed? 0123456789"], omni=True)
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == QWEN2_5_OMNI_CHAT_TEMPLATE
    tok = Tokenizer(d)
    v, audio = vision_token_ids(tok), audio_token_ids(tok)
    assert v["image_token_id"] == tok.token_to_id("<|IMAGE|>")
    assert v["vision_start_token_id"] == tok.token_to_id("<|vision_bos|>")
    assert audio["audio_token_id"] == tok.token_to_id("<|AUDIO|>")
    msgs = [{"role": "user", "content": "<audio><image>Which?"}, {"role": "assistant", "content": "42"}]
    ids, labels = tok.encode_conversation(msgs, _images(tok, [2]) | {"<audio>": [audio_placeholder(tok).block(3)]})
    start, pad, end = audio["audio_start_token_id"], audio["audio_token_id"], audio["audio_end_token_id"]
    a0 = ids.index(start)
    assert ids[a0:a0 + 5] == [start] + [pad] * 3 + [end]
    assert ids[a0 + 5:a0 + 9] == [v["vision_start_token_id"], v["image_token_id"], v["image_token_id"],
                                  v["vision_end_token_id"]]
    assert all(lab == -100 for lab in labels[a0:a0 + 9])
    with pytest.raises(ValueError, match="1 <audio> placeholders but 0 audio clips"):
        tok.encode_conversation(msgs, _images(tok, [2]))


def test_vl_tokenizer_refuses_audio(tok: Tokenizer) -> None:
    assert not tok.has("<|AUDIO|>")
    with pytest.raises(TokenizerError, match="no audio tokens"):  # the Omni processor's audio blocks need them
        audio_placeholder(tok)
