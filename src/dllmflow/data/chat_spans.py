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
  the word encoder's `encode_cuts` gives each chat's ids and its added tokens' places, the non-ASCII
  pieces of a chat encoded by the Rust tokenizer.

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
    if all(len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str
           for c in conversations for m in c):  # fmt: skip
        # prepare's rows ({role, content} strings): what transformers' renderer runs for each chat when
        # nothing is to be normalised (no objects, None values or reasoning fields to alias), called
        # directly: the rows are already the plain data it would copy them to
        return _render_plain(tok, conversations, add_generation_prompt)
    if not all(type(m) is dict and all(type(v) is str for v in m.values()) for c in conversations for m in c):
        return tok.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    # Messages of plain strings: apply_chat_template's normalising (message objects to dicts, None values
    # dropped) leaves them as they are, so its renderer is called directly (~25% less render time;
    # encode_chats's tagged path calls it the same way).
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, _ = render_jinja_template(
        conversations=conversations,
        chat_template=tok.get_chat_template(),
        add_generation_prompt=add_generation_prompt,
        **tok.special_tokens_map,
    )
    return texts


def _render_plain(tok, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
    """render_jinja_template's loop for chats of {role, content} strings: its compiled template (cached
    by transformers) on its arguments, each chat's context made as Template.render makes it
    (jinja2.runtime.new_context) from one merge of the template's globals and those arguments, not one
    per chat, and with the globals as a dict (a ChainMap's keys cost ~1.5 us a render); the sandbox
    refuses a template's writes to the messages, so they need no copy. A render that fails is run
    again through Template.render, which raises it as Jinja does."""
    from transformers.utils import chat_template_utils as ctu

    compiled = ctu._compile_jinja_template(tok.get_chat_template())
    kwargs = ctu._plain_template_data(dict(tok.special_tokens_map))
    kwargs.update(tools=None, documents=None, add_generation_prompt=add_generation_prompt)
    env, template_globals = compiled.environment, dict(compiled.globals)
    merged = {**template_globals, **kwargs}
    make, name, blocks, root = env.context_class, compiled.name, compiled.blocks, compiled.root_render_func
    out = []
    for c in conversations:
        try:
            out.append(env.concat(root(make(env, {**merged, "messages": c}, name, blocks, template_globals))))
        except Exception:
            out.append(compiled.render(messages=c, **kwargs))
    return out


class _Chat:
    """A rendered chat's ids and where its added tokens end: their end chars `ends` (ascending) and the
    chat's tokens up to each `counts`. No added tokens known: every prefix is encoded whole."""

    __slots__ = ("text", "ids", "ends", "counts")

    def __init__(self, text: str, ids: list[int], ends=(), counts=()):
        self.text, self.ids, self.ends, self.counts = text, ids, ends, counts

    def split(self, prefix: str) -> tuple[int, str]:
        """(k, tail): encode(prefix) = ids[:k] + encode(tail), see the module docstring."""
        if not self.ends or not self.text.startswith(prefix):
            return 0, prefix  # encoded whole: no added token to cut at, or not a string prefix
        j = bisect_right(self.ends, len(prefix)) - 1  # the prefix's last added token
        if j < 0:
            return 0, prefix
        return self.counts[j], prefix[self.ends[j] :]


def _encode_chats(tok, texts: list[str]) -> list[_Chat]:
    words = build_word_encoder(tok)
    if words is None:  # not a mirrored pipeline: ids only, each prefix is encoded whole
        return [_Chat(t, ids) for t, ids in zip(texts, encode_texts(tok, texts))]
    # ASCII word by word, non-ASCII pieces through the Rust tokenizer (word_encode.encode_cuts; the
    # mirrored pipeline has no truncation or padding to undo)
    encoded = words.encode_cuts(texts, tok.backend_tokenizer)
    return [_Chat(t, ids, ends, counts) for t, (ids, ends, counts) in zip(texts, encoded)]
