"""Chat ids and loss masks by the prefix rule, for chat templates without `{% generation %}` tags (most
on the Hub, SmolLM2's among them), at about one encode per chat.

The prefix rule (`tokenizer.encode_chat`, the reference): assistant turn i is supervised from token
len(encode(render(messages[:i], add_generation_prompt=True))) (0 for a first turn) up to
len(encode(render(messages[:i + 1]))), and those ids must begin the whole chat's ids. Done literally,
that renders and encodes each chat once per assistant-turn prefix (0.2-0.4x the tokenizer's own
`encode_batch` of the rendered chats). Here every needed prefix is rendered as a string (all chats in one
batched render per kind), each whole chat is encoded once, and a prefix's ids are read off the chat's:

  The tokenizer splits its added tokens (`<|im_start|>`, ...) off the text first and encodes each piece
  between them on its own. So when a prefix P of the chat T (as strings) has an added token ending at
  char b, encode(P) = encode(T)[:k] + encode(P[b:]), with k = T's tokens up to that added token: only
  the tail after the prefix's last added token (`assistant\\n`) is encoded, once per distinct tail.
  That holds for the pipelines the word encoder mirrors (no normalizer, a ByteLevel pre-tokenizer
  without prefix space, optionally after Digits, BPE, added tokens matched as written), for any text:
  a non-ASCII chat is encoded by the Rust tokenizer, whose offsets place its added tokens.

Everything else is encoded whole, in one batch, which is the prefix rule itself without the re-renders:
a prefix render that is not a string prefix of the chat's render (a template that renders a turn
differently once later turns follow, or a generation prompt the answer does not start with), and every
prefix of a tokenizer whose pipeline is not mirrored (e.g. a Metaspace `prepend_scheme="first"` encodes
a piece differently at the start of the text, so a tail cannot be encoded on its own). Same ids and
masks in every case (tests/unit/test_chat_spans.py, on SmolLM2's tokenizer and GSM8K).

    pairs = encode_by_prefix(tok, [messages, ...], mask_history=True)   # [(ids, loss_mask), ...]
"""

from __future__ import annotations

from bisect import bisect_right

from dllmflow.errors import UserError

from .word_encode import add_run, build_word_encoder, encode_texts, runs_mask

INCONSISTENT = (
    "tokenizer.chat_template renders earlier turns differently once later turns follow; "
    "set tokenizer.chat_template to one with {% generation %} tags"
)


def encode_by_prefix(
    tok, conversations: list[list[dict]], mask_history: bool = True
) -> list[tuple[list[int], list[int]]]:
    """`tokenizer.encode_chat` of each chat (a template without generation tags), batched: the same ids
    and masks, the same UserError for a template whose earlier turns' ids change later."""
    if not conversations:
        return []
    # Which renders the rule needs: each assistant turn's start (the turns before it and the generation
    # prompt) and end (the turns up to it; for the last message that is the whole chat).
    starts, ends = [], []  # (chat, turn)
    for c, messages in enumerate(conversations):
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                if i:
                    starts.append((c, i))
                if i < len(messages) - 1:
                    ends.append((c, i))
    # apply_chat_template's own render (what it tokenizes), all chats in one call per kind
    full = _render(tok, conversations, False)
    start_text = dict(zip(starts, _render(tok, [conversations[c][:i] for c, i in starts], True)))
    end_text = dict(zip(ends, _render(tok, [conversations[c][: i + 1] for c, i in ends], False)))

    chats = _encode_chats(tok, full)
    # Each prefix as (tokens of the chat it shares, tail text encoded on its own); tails once each
    start_at = {key: chats[key[0]].split(text) for key, text in start_text.items()}
    end_at = {key: chats[key[0]].split(text) for key, text in end_text.items()}
    tails = list(dict.fromkeys(tail for _, tail in (*start_at.values(), *end_at.values())))
    tail_ids = dict(zip(tails, encode_texts(tok, tails)))

    out = []
    for c, messages in enumerate(conversations):
        ids = chats[c].ids
        turns = []  # [start, end) of each assistant turn
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = 0
            if i:
                shared, tail = start_at[c, i]
                start = shared + len(tail_ids[tail])
            end = len(ids)
            if (c, i) in end_at:
                shared, tail = end_at[c, i]
                end = shared + len(tail_ids[tail])
                if ids[shared:end] != tail_ids[tail]:  # with ids[:shared] equal by construction
                    raise UserError(INCONSISTENT)
            if start < end:  # the reference sets nothing for an end before the start
                turns.append((start, end))
        runs: list[list[int]] = []  # the turns' union, touching turns joined (keep_last_run's runs)
        for start, end in sorted(turns):
            add_run(runs, start, end)
        out.append((ids, runs_mask(len(ids), runs, mask_history)))
    return out


def _render(tok, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    """What apply_chat_template renders (and then encodes) for each chat."""
    if not conversations:
        return []  # apply_chat_template refuses an empty batch
    if not all(type(m) is dict and all(type(v) is str for v in m.values()) for c in conversations for m in c):
        return tok.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    # Messages of plain strings (prepare's rows): apply_chat_template's normalising (message objects to
    # dicts, None values dropped) leaves them as they are, so its renderer is called directly (~25% less
    # render time; encode_chats's tagged path calls it the same way).
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, _ = render_jinja_template(
        conversations=conversations,
        chat_template=tok.get_chat_template(),
        add_generation_prompt=add_generation_prompt,
        **tok.special_tokens_map,
    )
    return texts


class _Chat:
    """A rendered chat's ids and where its added tokens end: units (the word encoder's words, or the
    Rust tokenizer's added tokens) with their end chars `ends` (ascending), the chat's tokens up to each
    `counts`, and `added(j)`: unit j is an added token. No units: every prefix is encoded whole."""

    def __init__(self, text: str, ids: list[int], ends=(), counts=(), added=lambda j: True):
        self.text, self.ids, self.ends, self.counts, self.added = text, ids, ends, counts, added

    def split(self, prefix: str) -> tuple[int, str]:
        """(k, tail): encode(prefix) = ids[:k] + encode(tail), see the module docstring."""
        if not self.ends or not self.text.startswith(prefix):
            return 0, prefix  # encoded whole: no added token to cut at, or not a string prefix
        j = bisect_right(self.ends, len(prefix)) - 1
        while j >= 0 and not self.added(j):  # back to the prefix's last added token: a few words
            j -= 1
        if j < 0:
            return 0, prefix
        return self.counts[j], prefix[self.ends[j] :]


def _encode_chats(tok, texts: list[str]) -> list[_Chat]:
    words = build_word_encoder(tok)
    if words is None:  # not a mirrored pipeline: ids only, each prefix is encoded whole
        return [_Chat(t, ids) for t, ids in zip(texts, encode_texts(tok, texts))]
    out: list = [None] * len(texts)
    rest = []
    for n, text in enumerate(texts):
        split = words.encode_words(text)
        if split is None:
            rest.append(n)
            continue
        ids, chat_words, ends, token_ends = split
        out[n] = _Chat(text, ids, ends, token_ends, lambda j, w=chat_words: words.is_added(w[j]))
    if rest:
        # non-ASCII: the Rust tokenizer (the mirrored pipeline has no truncation or padding to undo)
        added_text = {i: t.content for i, t in tok.backend_tokenizer.get_added_tokens_decoder().items()}
        encodings = tok.backend_tokenizer.encode_batch([texts[n] for n in rest], add_special_tokens=False)
        for n, enc in zip(rest, encodings):
            text, ends, counts = texts[n], [], []
            for j, (token, (b, e)) in enumerate(zip(enc.ids, enc.offsets)):
                if token in added_text and text[b:e] == added_text[token]:
                    ends.append(e)
                    counts.append(j + 1)
            out[n] = _Chat(text, enc.ids, ends, counts)
    return out
