"""data/word_encode.py: ASCII text of a byte-level BPE tokenizer encoded word by word. The reference is
the tokenizer itself (the Rust pipeline's ids and token offsets, and for chats transformers' own
`apply_chat_template(..., return_assistant_tokens_mask=True)` through `encode_chat`), on random text
built to hit the regex's corners: whitespace runs before letters, digits and line ends, contractions,
punctuation runs, control bytes, and added tokens, one a prefix of another."""

from __future__ import annotations

import random
from itertools import accumulate

import pytest

from dllmflow.data import word_encode
from dllmflow.data.tokenizer import _span_mask, encode_chat, encode_chats, train_bpe_tokenizer
from dllmflow.data.word_encode import build_word_encoder

_PIECES = [
    "hello", "World", "abc", "x", "I", "don't", "it's", "we'll", "they're", "I've", "I'm", "he'd", "'S",
    "'s", "'", "''", "7", "42", "2025", "3.14", "-1", "!!", "?", "...", ",", "(", ")", "#", "####", "$",
    "a-b", "e.g.", "\\", "{}", "_", "@x", "~", "`",
    " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\n ", "\r\n", "\x0b", "\x0c", " \t ", "\x1c", "\x1f", "\x00",
    "\x7f", "<|user|>", "<|us", "<|eos|>", "<|e",
]  # fmt: skip


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_PIECES) for _ in range(n))


@pytest.fixture(scope="module")
def digits_tok():
    """The BPE recipes' tokenizer (Digits + ByteLevel), trained on the random text, plus an added token
    that another one starts with (matched leftmost-longest by the tokenizer)."""
    rng = random.Random(0)
    tok = train_bpe_tokenizer((_text(rng, 40) for _ in range(400)), 600, "<|mask|>", "<|pad|>", "<|eos|>")
    tok.add_tokens(["<|e", "<|eos|>x"])
    return tok


@pytest.fixture(scope="module")
def plain_tok(request):
    """A GPT-2 style byte-level BPE (SmolLM2's pre-tokenizer: ByteLevel alone, digit runs kept together;
    GPT-2's post-processor, which trims the spaces off token offsets), with the recipes' chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|eos|>", "<|user|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    core.train_from_iterator((_text(rng, 40) for _ in range(400)), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|eos|>")
    tok.chat_template = request.getfixturevalue("digits_tok").chat_template
    return tok


@pytest.mark.parametrize("which", ["digits_tok", "plain_tok"])
def test_ascii_text_gets_the_tokenizers_ids(which, request):
    tok = request.getfixturevalue(which)
    words = build_word_encoder(tok)
    assert words is not None and build_word_encoder(tok) is words  # built once per tokenizer
    rng = random.Random(2)
    texts = [_text(rng, rng.randint(0, 60)) for _ in range(1500)]
    texts += ["", " ", "   a", "a   ", "1  2", "x\n\n  y", "''s", "<|eos|>x<|eos|>", "<|user|><|user|>"]
    want = [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]
    assert [words.encode(t) for t in texts] == want
    assert sum(map(len, want)) > 20_000  # the comparison covers a lot of tokens
    assert words.encode("café") is None and words.encode("a\u00a0b") is None  # not ASCII: the tokenizer's job


def test_the_word_cache_stays_bounded_and_exact(digits_tok, monkeypatch):
    monkeypatch.setattr(word_encode, "_MAX_WORDS", 50)
    words = word_encode._build(digits_tok)
    rng = random.Random(3)
    for _ in range(200):
        text = _text(rng, 30)
        assert words.encode(text) == digits_tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert len(words._cache) <= 50


@pytest.mark.parametrize("which", ["digits_tok", "plain_tok"])
def test_span_masks_follow_the_tokenizers_offsets_or_decline(which, request):
    tok = request.getfixturevalue(which)
    words = build_word_encoder(tok)
    rng = random.Random(4)
    answered = 0
    for _ in range(1500):
        text = _text(rng, 30)
        edges = [0, *accumulate(map(len, words.words(text)))]  # mostly word edges, some anywhere
        cuts = sorted(
            rng.choice(edges) if rng.random() < 0.9 else rng.randint(0, len(text)) for _ in range(4)
        )
        spans = [(cuts[0], cuts[1]), (cuts[2], cuts[3])]  # empty ones too
        got = words.encode_spans(text, spans)
        if got is None:
            continue  # a span edge inside a word: the caller asks the tokenizer
        answered += 1
        # the Rust tokenizer's token offsets, read the way encode_chats read them before
        enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
        assert got == _span_mask(enc, spans, False), (text, spans, enc.tokens, enc.offsets)
    assert answered > 600  # many edges fall between words: the check covers many masks


@pytest.mark.parametrize("which", ["digits_tok", "plain_tok"])
def test_chats_get_apply_chat_templates_ids_and_masks(which, request, monkeypatch):
    tok = request.getfixturevalue(which)
    answered = []
    real = word_encode.WordEncoder.encode_spans
    monkeypatch.setattr(word_encode.WordEncoder, "encode_spans",
                        lambda self, *a: answered.append(real(self, *a)) or answered[-1])  # fmt: skip
    rng = random.Random(5)
    chats = []
    for _ in range(150):
        turns = [
            {"role": "user", "content": _text(rng, 12)},
            {"role": "assistant", "content": _text(rng, 12)},
        ]
        if rng.random() < 0.3:
            turns = [{"role": "system", "content": _text(rng, 5)}, *turns, *turns]
        chats.append(turns)
    chats.append([{"role": "user", "content": "2 + 2?  "}, {"role": "assistant", "content": " 4  "}])
    chats.append([{"role": "user", "content": "café?"}, {"role": "assistant", "content": "oui"}])  # not ASCII
    for history in (True, False):
        assert encode_chats(tok, chats, history) == [encode_chat(tok, c, history) for c in chats]
    assert sum(a is not None for a in answered) > len(answered) // 2  # most took the word path


def test_pipelines_it_does_not_mirror_get_none(plain_tok):
    from tokenizers import normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def variant(change):
        core = plain_tok.backend_tokenizer.__class__.from_str(plain_tok.backend_tokenizer.to_str())
        change(core)
        return PreTrainedTokenizerFast(tokenizer_object=core)

    assert build_word_encoder(variant(lambda c: setattr(c, "normalizer", normalizers.NFKC()))) is None
    assert (
        build_word_encoder(variant(lambda c: setattr(c, "pre_tokenizer", pre_tokenizers.Metaspace()))) is None
    )
    assert (
        build_word_encoder(variant(lambda c: setattr(c, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True))))
        is None
    )  # fmt: skip
    from tokenizers import AddedToken

    assert build_word_encoder(variant(lambda c: c.add_tokens([AddedToken("<x>", lstrip=True)]))) is None
    assert build_word_encoder(variant(lambda c: c.enable_truncation(8))) is None
    assert build_word_encoder(variant(lambda c: c.enable_padding(length=64))) is None
    assert build_word_encoder(variant(lambda c: None)) is not None  # the unchanged copy is mirrored


def test_prepares_text_rows_get_the_tokenizers_ids(digits_tok):
    from types import SimpleNamespace

    from dllmflow.data.prepare_units import encode_rows

    rng = random.Random(6)
    rows = [{"text": _text(rng, 25)} for _ in range(100)] + [{"text": "naïve 7"}]  # the last: not ASCII
    want = digits_tok([r["text"] for r in rows], add_special_tokens=False)["input_ids"]
    want = [[*ids, digits_tok.eos_token_id] for ids in want]
    assert encode_rows(digits_tok, rows, SimpleNamespace(mask_history=True)) == [
        (w, [1] * len(w)) for w in want
    ]


_UNICODE = [
    "café", "naïve", "Ωmega", "中文", "🙂", "e\u0301", "٣", "½", "’", "–", "€5", "x\u00a0y",
    "\u00a0", "\u2028", "\u3000", "\u200b", "\x85", " \u00a0", "\u00a0 ", "é<|eos|>", "<|e\u00e9",
]  # fmt: skip


class _Counting:
    """A backend that counts the chars it is asked to encode."""

    def __init__(self, backend):
        self.backend, self.chars = backend, 0

    def encode_batch(self, texts, add_special_tokens):
        self.chars += sum(map(len, texts))
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)


def _check_cuts(tok, texts: list[str], got) -> None:
    """Ids as the tokenizer's; each (end, count) a place where the text up to `end` encodes to the
    first `count` ids, after an added token."""
    backend = tok.backend_tokenizer
    assert [ids for ids, _, _ in got] == [
        e.ids for e in backend.encode_batch(texts, add_special_tokens=False)
    ]
    heads, want = [], []
    for text, (ids, ends, counts) in zip(texts, got):
        assert ends == sorted(ends) and len(ends) == len(counts)
        for end, count in zip(ends, counts):
            heads.append(text[:end])
            want.append(ids[:count])
    assert [e.ids for e in backend.encode_batch(heads, add_special_tokens=False)] == want
    assert len(heads) > 300  # many added tokens: the cuts are checked


@pytest.mark.parametrize("which", ["digits_tok", "plain_tok"])
def test_any_text_gets_the_tokenizers_ids_and_cuts(which, request):
    """encode_cuts on text mixing the ASCII corners with non-ASCII letters, digits, spaces and marks: the
    tokenizer's ids, only the non-ASCII pieces sent to it (cut between an ASCII non-space and space)."""
    tok = request.getfixturevalue(which)
    words = build_word_encoder(tok)
    rng = random.Random(7)
    pieces = _PIECES * 4 + _UNICODE  # a non-ASCII piece in ~10
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 50))) for _ in range(1500)]
    texts += ["é", " é", "é ", "a é b", "1é2", "\u00a0 a", "a \u00a0", "x  é", "é\n\nx", "<|eos|>é<|eos|>"]
    counting = _Counting(tok.backend_tokenizer)
    got = words.encode_cuts(texts, counting)
    _check_cuts(tok, texts, got)
    unicode_chars = sum(len(t) for t in texts if not t.isascii())
    assert sum(not t.isascii() for t in texts) > 1000 and counting.chars < 0.5 * unicode_chars


def test_non_ascii_added_tokens_have_non_ascii_text_encoded_whole(digits_tok):
    """An added token with a non-ASCII char can overlap an ASCII one (`é<|eos` vs `<|eos|>`): the
    tokenizer matches the leftmost, so such a tokenizer's non-ASCII texts go to it whole, their
    added tokens placed by its offsets."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(digits_tok.backend_tokenizer.to_str()))
    tok.add_tokens(["é<|eos", "ß"])
    words = build_word_encoder(tok)
    rng = random.Random(8)
    texts = [
        "".join(rng.choice(_PIECES + _UNICODE + ["é<|eos|>", "ß"]) for _ in range(40)) for _ in range(500)
    ]
    counting = _Counting(tok.backend_tokenizer)
    got = words.encode_cuts(texts, counting)
    _check_cuts(tok, texts, got)
    assert counting.chars == sum(len(t) for t in texts if not t.isascii())
