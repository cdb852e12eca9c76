"""Exact, faster encoding of ASCII text for byte-level BPE tokenizers (GPT-2 style: SmolLM2's, the BPE
recipes'): the text is split into words the way the tokenizer's pre-tokenizer splits it, and each
distinct word is encoded once by the tokenizer's own BPE model and cached, so a chat costs a regex pass
and a dict lookup per word instead of the whole Rust pipeline per token (~2.3x the rows per CPU-second
of `encode_batch` on bench/data_scale.py's chats). Used by `tokenizer.encode_chats` (and, for templates
without generation tags, chat_spans.py, which also cuts prefixes at its added tokens) and by
prepare's text rows; the ids are the tokenizer's (tests/unit/test_word_encode.py compares them on random
text, tests/unit/test_chat_spans.py on SmolLM2's tokenizer and GSM8K).

Only where the split is certain: a tokenizer with no normalizer, a `ByteLevel` pre-tokenizer with its
regex (optionally after `Digits(individual_digits=True)`), a BPE model without dropout, and added tokens
matched as written (no lstrip/rstrip/single_word); and only ASCII text, where the regex's classes
(letters, digits, whitespace) mean the same in Python's `re` as in the tokenizer's Oniguruma. Any other
tokenizer gets None from `build_word_encoder`, any other text None from `encode`: the caller uses the
tokenizer itself. `encode_cuts` takes any text: a non-ASCII text is cut where no word can span the cut
(after an ASCII non-space char, before an ASCII space: `_CUT`), its ASCII pieces encoded word by word
and only the pieces holding non-ASCII chars by the tokenizer, in one batch (GSM8K's non-ASCII chats,
~9%, hold a few such chars each).

    words = build_word_encoder(tok)                   # None: not a pipeline it mirrors
    ids = words.encode(text)                          # None: not ASCII
    ids, mask = words.encode_spans(text, spans)       # None also when a span edge falls inside a word
    pairs = words.encode_cuts(texts, tok.backend_tokenizer)   # [(ids, added-token end chars, tokens
                                                              #   up to each)] (data/chat_spans.py)
    id_lists = encode_texts(tok, texts)               # any tokenizer: word by word where it applies
"""

from __future__ import annotations

import json
import re
import weakref
from bisect import bisect_left
from itertools import accumulate, chain

# The ByteLevel pre-tokenizer's regex (GPT-2's) with its classes spelled out for ASCII: \p{L} = letters,
# \p{N} = digits, \s = Oniguruma's ASCII whitespace (Python's \s would also take \x1c-\x1f).
_WS = r"\t\n\x0b\x0c\r "
_BYTE_LEVEL = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
# Digits(individual_digits=True) first, then ByteLevel on each piece between digits, in one pass: a digit
# is a word of its own (no space before it), and a whitespace run ends its piece at a digit as at the end.
_DIGITS_BYTE_LEVEL = re.compile(
    rf"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+|[0-9]| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}0-9])|[{_WS}]+"
)
# Where a text can be cut and each side encoded on its own, for any regex flavour (Oniguruma's Unicode
# classes included): after an ASCII non-space char, before an ASCII space char. A pre-tokenizer word holds
# whitespace only as a run of it or as one leading space, so no word spans the cut; the regex never looks
# back and looks ahead only at a whitespace run's end (never at the cut: the char before is not a space);
# Digits isolates each digit wherever the text is cut.
_CUT = re.compile(rf"(?<=[!-~])(?=[{_WS}])")
_MAX_WORDS = 1 << 17  # cached words before the cache starts over (~25 MB): memory stays bounded
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable char map (what ByteLevel feeds the BPE model)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()


class WordEncoder:
    """A tokenizer's ids for ASCII text, word by word (see the module docstring)."""

    def __init__(self, model, added: dict[str, int], normalized: set[str], digits: bool, added_text=None):
        self._model, self._regex = model, _DIGITS_BYTE_LEVEL if digits else _BYTE_LEVEL
        # id -> content of every added token (None: only `added`, all ASCII); when all are ASCII, this
        # splits them off a non-ASCII text too (the tokenizer would match the same ones)
        self._added_text = added_text if added_text is not None else {v: k for k, v in added.items()}
        self._cut = all(t.isascii() for t in self._added_text.values())
        self._added = {k: [v] for k, v in added.items()}
        # The tokenizer splits the added tokens it matches as written first, then, in what is left, the
        # ones it matches after normalizing (none here); each pass leftmost-longest. A pass with nothing
        # to match is left out (one level less per piece of every text).
        passes = [_alternation([t for t in added if t not in normalized]), _alternation(sorted(normalized))]
        self._passes = [split for split in passes if split is not None]
        self._cache: dict[str, list[int]] = dict(self._added)

    def words(self, text: str) -> list[str]:
        """The text's words in order, added tokens included; they concatenate to `text`."""
        out: list[str] = []
        self._words(text, 0, out)
        return out

    def _words(self, text: str, depth: int, out: list[str]) -> None:
        if depth == len(self._passes):
            out += self._regex.findall(text)
            return
        for i, part in enumerate(self._passes[depth].split(text)):
            if i % 2:  # an added token (the split's capture group)
                out.append(part)
            elif part:
                self._words(part, depth + 1, out)

    def _ids(self, word: str) -> list[int]:
        """A word the cache lacks: the BPE model's ids of its bytes (as ByteLevel maps them)."""
        if len(self._cache) >= _MAX_WORDS:
            self._cache = dict(self._added)
        mapped = "".join(_BYTE_CHARS[b] for b in word.encode())
        ids = self._cache[word] = [t.id for t in self._model.tokenize(mapped)]
        return ids

    def _per_word(self, words: list[str]) -> list[list[int]]:
        get = self._cache.get
        return [get(w) or self._ids(w) for w in words]  # a word has at least one token

    def encode(self, text: str) -> list[int] | None:
        """The tokenizer's ids of `text` (no special tokens added), or None for non-ASCII text."""
        if not text.isascii():
            return None
        return list(chain.from_iterable(self._per_word(self.words(text))))

    def encode_words(self, text: str) -> tuple[list[int], list[str], list[int], list[int]] | None:
        """(ids, words, each word's end char, the tokens up to each word's end) of `text`, or None for
        non-ASCII text. Added tokens are words of their own."""
        if not text.isascii():
            return None
        words = self.words(text)
        per_word = self._per_word(words)
        ends = list(accumulate(map(len, words)))
        return list(chain.from_iterable(per_word)), words, ends, list(accumulate(map(len, per_word)))

    def _word_ids(self, text: str) -> list[list[int]]:
        """Each word's ids of ASCII text without added tokens: a regex pass, a cache lookup per word."""
        words = self._regex.findall(text)
        per_word = list(map(self._cache.get, words))
        if None in per_word:  # a word has at least one token: None only for a word the cache lacks
            per_word = [ids or self._ids(w) for ids, w in zip(per_word, words)]
        return per_word

    def encode_cuts(self, texts: list[str], backend) -> list[tuple[list[int], list[int], list[int]]]:
        """(ids, ends, counts) of each text (no special tokens added): its ids, and after each of its
        added tokens that token's end char and the number of tokens up to it (where data/chat_spans.py
        cuts a prefix). Any text: ASCII word by word; the pieces of a non-ASCII text that hold non-ASCII
        chars (cut at `_CUT`) by the Rust tokenizer `backend`, in one call for all the texts. A tokenizer
        with non-ASCII added tokens has a non-ASCII text encoded whole there, its added tokens placed by
        the token offsets (a non-ASCII token could overlap an ASCII one where this splits them)."""
        out: list = [None] * len(texts)
        rest: list = []  # (text's index, chunks: [[ids per word] | index into rust], cuts: [(char, chunks)])
        rust: list[str] = []  # pieces, and texts encoded whole (a `rest` entry without chunks)
        one_pass = len(self._passes) == 1
        for n, text in enumerate(texts):
            if one_pass and text.isascii():  # most texts: the tokens flattened as the pieces come
                out[n] = self._ascii_cuts(text)
            elif self._cut or text.isascii():
                chunks: list = []
                cuts: list[tuple[int, int]] = []
                self._chunks(text, 0, 0, chunks, cuts, rust)
                rest.append((n, chunks, cuts))
            else:
                rest.append((n, len(rust), None))
                rust.append(text)
        encoded = backend.encode_batch(rust, add_special_tokens=False) if rust else []
        for n, chunks, cuts in rest:
            if cuts is None:
                out[n] = self._offset_cuts(texts[n], encoded[chunks])
                continue
            ids: list[int] = []
            counts, c = [], 0
            for k, chunk in enumerate(chunks, 1):
                if type(chunk) is int:
                    ids += encoded[chunk].ids
                else:
                    ids.extend(chain.from_iterable(chunk))
                while c < len(cuts) and cuts[c][1] == k:
                    counts.append(len(ids))
                    c += 1
            out[n] = (ids, [end for end, _ in cuts], counts)
        return out

    def _ascii_cuts(self, text: str) -> tuple[list[int], list[int], list[int]]:
        """encode_cuts of ASCII text, for a tokenizer whose added tokens split off in one pass."""
        ids: list[int] = []
        ends, counts, pos = [], [], 0
        for i, part in enumerate(self._passes[0].split(text)):
            pos += len(part)
            if i % 2:  # an added token (the split's capture group)
                ids += self._added[part]
                ends.append(pos)
                counts.append(len(ids))
            elif part:
                words, start = self._regex.findall(part), len(ids)
                try:  # the cache holds every word but a few: their ids straight off it
                    ids.extend(chain.from_iterable(map(self._cache.get, words)))
                except TypeError:  # a word it lacks (None): this piece again, word by word
                    del ids[start:]
                    ids.extend(chain.from_iterable(self._word_ids(part)))
        return ids, ends, counts

    def _offset_cuts(self, text: str, enc) -> tuple[list[int], list[int], list[int]]:
        ends, counts = [], []
        for j, (token, (b, e)) in enumerate(zip(enc.ids, enc.offsets)):
            if token in self._added_text and text[b:e] == self._added_text[token]:
                ends.append(e)
                counts.append(j + 1)
        return enc.ids, ends, counts

    def _chunks(self, text: str, depth: int, pos: int, chunks: list, cuts: list, rust: list[str]) -> int:
        """`text` (at char `pos` of its whole) into `chunks` and `cuts` (see encode_cuts), its added
        tokens split off pass by pass as the tokenizer does; returns the char after it."""
        if depth < len(self._passes):
            for i, part in enumerate(self._passes[depth].split(text)):
                if i % 2:  # an added token (the split's capture group)
                    chunks.append([self._added[part]])
                    pos += len(part)
                    cuts.append((pos, len(chunks)))
                elif part:
                    pos = self._chunks(part, depth + 1, pos, chunks, cuts, rust)
            return pos
        if text.isascii():
            chunks.append(self._word_ids(text))
            return pos + len(text)
        ascii_run = ""  # ASCII pieces next to each other: one run of words
        for piece in _CUT.split(text) if self._cut else [text]:
            if piece.isascii():
                ascii_run += piece
                continue
            if ascii_run:
                chunks.append(self._word_ids(ascii_run))
                ascii_run = ""
            if chunks and type(chunks[-1]) is int:
                rust[chunks[-1]] += piece  # next to the previous Rust piece: one piece
            else:
                chunks.append(len(rust))
                rust.append(piece)
        if ascii_run:
            chunks.append(self._word_ids(ascii_run))
        return pos + len(text)

    def encode_spans(
        self, text: str, spans: list[tuple[int, int]], last_only: bool = False
    ) -> tuple[list[int], list[int]] | None:
        """(ids, mask): mask 1 on the tokens of the words inside a (start, end) char span, what the
        tokenizer's offsets give (`tokenizer._span_mask`) when every edge falls between words; with
        `last_only` only the last run of such tokens (`keep_last_run`). None for non-ASCII text, an edge
        inside a word, or a span whose first word starts or last word ends with a space (where trimmed
        token offsets decide)."""
        split = self.encode_words(text)
        if split is None:
            return None
        ids, words, ends, token_ends = split  # each word's end char, tokens up to its end
        tokens = [0, *token_ends]  # tokens before each word
        runs: list[list[int]] = []  # [first token, end token) of the masked runs, touching ones joined
        for start, end in spans:
            if end <= start:
                continue
            first, last = bisect_left(ends, start + 1), bisect_left(ends, end)  # words holding start, end-1
            if last == len(ends) or (ends[first - 1] if first else 0) != start or ends[last] != end:
                return None
            if words[first].startswith(" ") or words[last].endswith(" "):
                return None  # a token of spaces at a span's edge: a ByteLevel post-processor trims its
                # offsets to an empty range at the edge, which the tokenizer's rule leaves unmasked
            add_run(runs, tokens[first], tokens[last + 1])
        return ids, runs_mask(tokens[-1], runs, last_only)


def add_run(runs: list[list[int]], lo: int, hi: int) -> None:
    """Append the token run [lo, hi) to `runs` (in order), joined to the last one when they touch (so
    the last run is `keep_last_run`'s last run)."""
    if runs and lo <= runs[-1][1]:
        runs[-1][1] = max(runs[-1][1], hi)
    else:
        runs.append([lo, hi])


def runs_mask(n: int, runs: list[list[int]], last_only: bool) -> list[int]:
    """A 0/1 mask over n tokens: 1 on `runs` (only the last with `last_only`)."""
    mask = [0] * n
    for lo, hi in runs[-1:] if last_only else runs:
        mask[lo:hi] = [1] * (hi - lo)
    return mask


def keep_last_run(mask: list[int]) -> list[int]:
    """Zero every supervised run except the last contiguous one (docs/strategies.md §1.3 mask_history)."""
    out = [0] * len(mask)
    i = len(mask) - 1
    while i >= 0 and not mask[i]:
        i -= 1
    while i >= 0 and mask[i]:
        out[i] = 1
        i -= 1
    return out


def encode_texts(tok, texts: list[str]) -> list[list[int]]:
    """The tokenizer's ids of each text (no special tokens added): ASCII text of a byte-level BPE word
    by word, the rest in one call of the tokenizer."""
    words = build_word_encoder(tok)
    out: list = [words.encode(t) if words else None for t in texts]
    rest = [i for i, ids in enumerate(out) if ids is None]
    if rest:
        for i, ids in zip(rest, tok([texts[i] for i in rest], add_special_tokens=False)["input_ids"]):
            out[i] = list(ids)
    return out


def _alternation(tokens: list[str]) -> re.Pattern | None:
    """One capture group of `tokens`, longest first (leftmost-longest, as the tokenizer's trie)."""
    if not tokens:
        return None
    return re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


def build_word_encoder(tok) -> WordEncoder | None:
    """The tokenizer's WordEncoder (built once per tokenizer), or None when its pipeline is not one
    the word split mirrors exactly."""
    if tok in _ENCODERS:
        return _ENCODERS[tok]
    _ENCODERS[tok] = encoder = _build(tok)
    return encoder


def _build(tok) -> WordEncoder | None:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(backend, "encode_special_tokens", False):
        return None
    # Read from the pipeline's parts, not `json.loads(backend.to_str())`: that parses the whole
    # vocabulary and merges (~0.2 s for SmolLM2's 49k), once per tokenizer in every prepare worker.
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    model = backend.model
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    digits = len(steps) == 2 and steps[0] == {"type": "Digits", "individual_digits": True}
    byte_level = steps[-1] if steps else {}
    mirrored = (
        backend.normalizer is None
        and backend.truncation is None  # the tokenizer would cut or pad what it returns
        and backend.padding is None
        and len(steps) == 1 + digits
        and byte_level.get("type") == "ByteLevel"
        and byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space", False)
        and type(model).__name__ == "BPE"
        and model.dropout is None
        and not model.continuing_subword_prefix
        and not model.end_of_word_suffix
    )
    added = backend.get_added_tokens_decoder()  # id -> AddedToken
    if not mirrored or any(a.lstrip or a.rstrip or a.single_word for a in added.values()):
        return None
    # ASCII text only: a non-ASCII added token never occurs in it
    ascii_added = {i: a for i, a in added.items() if a.content and a.content.isascii()}
    normalized = {a.content for a in ascii_added.values() if a.normalized}
    added_text = {i: a.content for i, a in added.items()}
    return WordEncoder(model, {a.content: i for i, a in ascii_added.items()}, normalized, digits, added_text)
