"""Tokenizers for dLLM data: any Hugging Face tokenizer by id/path, or a byte-level BPE trained with
`tokenizers` on the training text; both end up with mask/pad/eos tokens and a chat template. A
template's `{% generation %}` spans mark the supervised assistant tokens; a template without them (a
pretrained model's own, mostly) supervises what each assistant turn adds to the render (the prefix
rule, `_assistant_mask_by_prefix`; batched in chat_spans.py).

    tok = build_tokenizer(settings, texts)        # during `dllmflow prepare`
    tok = load_tokenizer("data/prepared/tiny")     # the one saved with the prepared data
    ids, loss_mask = encode_chat(tok, messages, mask_history=True)
    pairs = encode_chats(tok, [messages, ...], mask_history=True)   # batched, same results
    id_lists = encode_texts(tok, ["plain text", ...])                # no special tokens added

A directory without tokenizer files loads in transformers as an empty tokenizer (every text encodes
to nothing): `check_tokenizer_files` refuses it where a tokenizer enters (here and at generation),
`check_tokenizer_fits` refuses one whose ids the model cannot look up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from dllmflow.errors import UserError

from .chat_spans import INCONSISTENT, encode_by_prefix
from .word_encode import (
    add_run,
    build_word_encoder,
    encode_texts,  # noqa: F401 - re-exported (prepare's text rows)
    keep_last_run,
    runs_mask,
)

TEMPLATE_PATH = Path(__file__).with_name("templates") / "chat.jinja"
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")  # used by templates/chat.jinja


def default_chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def build_tokenizer(settings, texts: Iterable[str]):
    """The tokenizer `settings` asks for: `tokenizer.name_or_path`, else the pretrained model's, else
    a BPE of `tokenizer.train_vocab_size` trained on `texts`."""
    tcfg = settings.tokenizer
    name = tcfg.name_or_path or settings.model.pretrained_model_name_or_path
    if name is None:
        tok = train_bpe_tokenizer(
            texts, tcfg.train_vocab_size, tcfg.mask_token, tcfg.pad_token, tcfg.eos_token
        )
    else:
        tok = _load_pretrained(name, settings)
        _ensure_special_tokens(tok, settings)
    template = _template_override(tcfg.chat_template)
    if template is not None:
        tok.chat_template = template
    elif not getattr(tok, "chat_template", None):
        tok.chat_template = default_chat_template()
    return tok


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, mask_token: str, pad_token: str, eos_token: str
):
    """Byte-level BPE (lossless on any text) with single-digit pre-splitting, which helps arithmetic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [pad_token, eos_token, mask_token, *ROLE_TOKENS]
    if len(set(specials)) != len(specials):
        raise UserError(f"tokenizer.mask_token/pad_token/eos_token must be distinct, got {specials[:3]}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=pad_token,
        eos_token=eos_token,
        mask_token=mask_token,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=default_chat_template(),
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def _load_pretrained(name: str, settings):
    from transformers import AutoTokenizer

    kwargs = {"trust_remote_code": settings.model.trust_remote_code}
    if settings.model.gguf_file and name == settings.model.pretrained_model_name_or_path:
        kwargs["gguf_file"] = settings.model.gguf_file
    try:
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        field = (
            "tokenizer.name_or_path"
            if settings.tokenizer.name_or_path
            else "model.pretrained_model_name_or_path"
        )
        raise UserError(f"{field}={name!r}: cannot load a tokenizer ({e.__class__.__name__}: {e})") from None
    if not getattr(tok, "is_fast", False):
        raise UserError(
            f"tokenizer {name!r} is not a fast tokenizer; dllmflow needs offsets for the assistant mask"
        )
    return tok


def _ensure_special_tokens(tok, settings) -> None:
    """Give a pretrained tokenizer what dLLM training needs: a mask token (added unless
    `dllm.mask_token_id` names an existing one), an eos, and a pad (eos when missing)."""
    tcfg, mask_id = settings.tokenizer, settings.dllm.mask_token_id
    if mask_id is not None:
        if mask_id == len(tok) and tok.mask_token_id is None:
            # The next free id (Qwen3's 151669, the I-DLM recipe's mask): the model's embedding already
            # has that row (padded vocab), so adding the token claims it without a resize.
            tok.add_special_tokens({"mask_token": tcfg.mask_token})
        if not 0 <= mask_id < len(tok):
            raise UserError(
                f"dllm.mask_token_id={mask_id} is outside the tokenizer vocabulary (size {len(tok)}); "
                f"name an existing token's id, or {len(tok)} (the next free one) to add tokenizer.mask_token"
            )
        if tok.mask_token_id is None:
            tok.mask_token = tok.convert_ids_to_tokens(mask_id)
    elif tok.mask_token_id is None:
        tok.add_special_tokens({"mask_token": tcfg.mask_token})  # the model resizes to len(tokenizer)
    if tok.eos_token_id is None:
        tok.add_special_tokens({"eos_token": tcfg.eos_token})
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # no new row in the embedding; rows are padded only by the collator


def _template_override(value: str | None) -> str | None:
    if value is None:
        return None
    if "{" not in value and os.path.isfile(value):
        return Path(value).read_text()
    if "{" not in value:
        raise UserError(f"tokenizer.chat_template={value!r} is neither a Jinja template nor an existing file")
    return value


def load_tokenizer(prepared_dir: str | os.PathLike):
    """The tokenizer saved by `dllmflow prepare` in `prepared_dir/tokenizer`."""
    from transformers import AutoTokenizer

    path = Path(prepared_dir) / "tokenizer"
    if not path.is_dir():
        raise UserError(f"{path}: no prepared tokenizer; run `dllmflow prepare --params <recipe.yaml>` first")
    check_tokenizer_files(path, fix="run `dllmflow prepare --params <recipe.yaml>` again")
    return AutoTokenizer.from_pretrained(str(path))


# Any one of these holds a tokenizer's vocabulary: the fast serialisation, or a slow tokenizer's file.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                   "vocab.json", "vocab.txt", "tekken.json")  # fmt: skip


def check_tokenizer_files(path: str | os.PathLike, fix: str | None = None) -> None:
    """UserError naming `path` when it holds no tokenizer vocabulary file."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        fix = fix or "save the model's tokenizer next to its weights (`tokenizer.save_pretrained(dir)`)"
        raise UserError(
            f"{path}: no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); transformers would load "
            f"an empty tokenizer and generate garbage; {fix}"
        )


def check_tokenizer_fits(tok, num_rows: int | None, where: str | os.PathLike) -> None:
    """UserError when the tokenizer has more tokens than the model's embedding has rows, or a special
    id (mask, eos, pad) the model cannot look up: a tokenizer that is not this model's."""
    if num_rows is None:
        return
    if len(tok) > num_rows:
        raise UserError(
            f"{where}: the tokenizer has {len(tok)} tokens but the model's embedding only {num_rows} rows; "
            "the tokenizer files are not the model's (save the tokenizer it was trained with next to it)"
        )
    for name in ("mask_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tok, name, None)
        if token_id is not None and not 0 <= token_id < num_rows:
            raise UserError(
                f"{where}: the tokenizer's {name}={token_id} is outside the model's embedding "
                f"(0..{num_rows - 1}); the tokenizer files are not the model's"
            )


def check_generation_tokenizer(
    tok, num_rows: int | None, where: str | os.PathLike, mask_id: int | None
) -> None:
    """What generation needs of a loaded model's tokenizer, checked at once: it fits the model's embedding
    (`check_tokenizer_fits`) and has the special tokens answers need (`check_tokenizer_specials`)."""
    check_tokenizer_fits(tok, num_rows, where)
    check_tokenizer_specials(tok, where, mask_id)


def check_tokenizer_specials(tok, where: str | os.PathLike, mask_id: int | None = None) -> None:
    """UserError naming the special tokens generation needs that `tok` lacks: an eos (where an answer
    ends) and a mask token (what diffusion fills in; a `mask_id` resolved elsewhere will do when it is
    one of this tokenizer's ids). A tokenizer without them decodes every answer to empty text."""
    missing = [] if tok.eos_token_id is not None else ["eos_token"]
    if tok.mask_token_id is None and not (mask_id is not None and 0 <= mask_id < len(tok)):
        missing.append(
            "mask_token"
            + (f" (mask id {mask_id} is not one of its {len(tok)} ids)" if mask_id is not None else "")
        )
    if missing:
        raise UserError(
            f"{where}: the tokenizer has no {' and no '.join(missing)} ({len(tok)} tokens): generation needs "
            "them; save the tokenizer the model was trained with next to its weights"
        )


# ---- chat -> (input_ids, loss_mask) --------------------------------------------------------------


def encode_chat(tok, messages: list[dict], mask_history: bool = True) -> tuple[list[int], list[int]]:
    """Unshifted token ids of the rendered chat and a 0/1 mask over the assistant tokens (content +
    closing eos/turn token); with `mask_history` only the final assistant turn stays supervised."""
    if _GENERATION_TAG.search(tok.chat_template or ""):
        enc = tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(enc["input_ids"]), [int(bool(m)) for m in enc["assistant_masks"]]
    else:
        ids, mask = _assistant_mask_by_prefix(tok, messages)
    if mask_history:
        mask = keep_last_run(mask)
    return ids, mask


def encode_chats(
    tok, conversations: list[list[dict]], mask_history: bool = True
) -> list[tuple[list[int], list[int]]]:
    """`encode_chat` of many chats at once, with the same ids and masks. A template without generation
    tags: the prefix rule with each prefix rendered once as a string and each chat encoded once
    (chat_spans.py). With tags: the template rendered with its `{% generation %}` spans (transformers'
    renderer, as apply_chat_template does), the texts encoded in one call of the Rust tokenizer, and a
    token supervised when it overlaps a span (apply_chat_template's rule) computed on the token offsets
    there, not token by token in Python."""
    if not conversations:
        return []
    if not _GENERATION_TAG.search(tok.chat_template or ""):
        return encode_by_prefix(tok, conversations, mask_history)
    if not getattr(tok, "is_fast", False):
        return [encode_chat(tok, m, mask_history) for m in conversations]
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, spans = render_jinja_template(
        conversations=conversations,
        chat_template=tok.get_chat_template(),
        return_assistant_tokens_mask=True,
        **tok.special_tokens_map,
    )
    # ASCII chats of a byte-level BPE word by word (word_encode.py: the same ids, faster), the rest
    # (and a span edge inside a word) through the Rust tokenizer's offsets
    words = build_word_encoder(tok)
    out: list = [words.encode_spans(t, gen, mask_history) if words else None for t, gen in zip(texts, spans)]
    rest = [i for i, o in enumerate(out) if o is None]
    encodings = tok.backend_tokenizer.encode_batch([texts[i] for i in rest], add_special_tokens=False)
    for i, enc in zip(rest, encodings):
        out[i] = _span_mask(enc, spans[i], mask_history)
    return out


def _span_mask(enc, spans: list[tuple[int, int]], mask_history: bool) -> tuple[list[int], list[int]]:
    """(ids, mask) of one encoding: the tokens overlapping any (start, end) char span (spans in order,
    token offsets ascending, so each span's tokens are one index range)."""
    ids, runs = enc.ids, []
    for start, end in spans:
        if end <= start:
            continue
        lo, hi = enc.char_to_token(start), enc.char_to_token(end - 1)
        if lo is None or hi is None:  # a char no token covers: apply_chat_template's own rule
            return ids, _overlap_mask(enc.offsets, spans, mask_history)
        add_run(runs, lo, hi + 1)
    return ids, runs_mask(len(ids), runs, mask_history)


def _overlap_mask(offsets, spans, mask_history: bool) -> list[int]:
    mask = [int(any(e > s0 and b < s1 for s0, s1 in spans)) for b, e in offsets]
    return keep_last_run(mask) if mask_history else mask


def _render_ids(tok, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    enc = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=add_generation_prompt
    )
    return list(enc["input_ids"])


def _assistant_mask_by_prefix(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """For templates without generation tags: an assistant turn is what rendering it adds after the
    generation prompt of the turns before it. One chat, rendered and encoded once per prefix: the
    reference that chat_spans.encode_by_prefix (what `encode_chats` runs) computes in a batch."""
    ids = _render_ids(tok, messages)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render_ids(tok, messages[:i], add_generation_prompt=True)) if i else 0
        upto = _render_ids(tok, messages[: i + 1])
        if ids[: len(upto)] != upto:
            raise UserError(INCONSISTENT)
        mask[start : len(upto)] = [1] * (len(upto) - start)
    return ids, mask
