"""DLLMCollator against docs/strategies.md §1.3, checked position by position with a direct reference written here."""

from __future__ import annotations

import math

import pytest
import torch

from dllmflow.data.collate import DLLMCollator, supervised_runs
from dllmflow.errors import UserError

PAD, EOS = 0, 1


def row(n_prompt: int, n_resp: int, start: int = 10) -> dict:
    ids = list(range(start, start + n_prompt + n_resp))
    return {"input_ids": ids, "loss_mask": [0] * n_prompt + [1] * n_resp}


def reference(rows, bs=None, d=None, max_len=None, sup_pad=False, window=False, pad=PAD, eos=EOS):
    """Unoptimised docs/strategies.md §1.3: fill ends, target length, then one rule per position."""
    bs = bs if bs and bs > 1 else None
    fills = []
    for r in rows:
        cl = len(r["input_ids"])
        capped = min(cl, max_len) if max_len else cl
        if bs is None:
            fills.append(capped)
            continue
        prefix = 0
        if window:
            prefix = min(r["loss_mask"].index(1) if 1 in r["loss_mask"] else capped, capped)
        fills.append(prefix + math.ceil((capped - prefix) / bs) * bs)
    T = max(fills)
    if d and d > 1:
        m = math.lcm(bs or 1, d)
        T = -(-T // m) * m
    if max_len:
        T = min(T, max_len)
    T = max(T, 1)
    block_pad = eos if eos is not None else pad
    out = {"input_ids": [], "loss_mask": [], "attention_mask": []}
    for r, fe in zip(rows, fills):
        cl = len(r["input_ids"])
        ii, lm, am = [], [], []
        for t in range(T):
            if t < cl:
                ii.append(r["input_ids"][t]), lm.append(r["loss_mask"][t]), am.append(1)
            elif t < fe:
                ii.append(block_pad), lm.append(1), am.append(1 if window else 0)
            else:
                ii.append(pad), lm.append(1 if sup_pad else 0), am.append(0)
        out["input_ids"].append(ii), out["loss_mask"].append(lm), out["attention_mask"].append(am)
    return out


def check(batch, ref):
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["input_ids"].tolist() == ref["input_ids"]
    assert batch["loss_mask"].tolist() == [[float(x) for x in r] for r in ref["loss_mask"]]
    assert batch["attention_mask"].tolist() == ref["attention_mask"]


ROWS = [row(3, 4), row(5, 9, start=40), row(2, 1, start=80)]  # content lengths 7, 14, 3


def test_basic_keys_shapes_content_and_lengths():
    batch = DLLMCollator(PAD, EOS)(ROWS)
    assert set(batch) == {"input_ids", "loss_mask", "attention_mask", "input_lengths"}
    assert batch["input_ids"].shape == (3, 14)  # padded to the longest sample
    assert batch["input_lengths"].tolist() == [7, 14, 3]
    assert batch["input_ids"][0, :7].tolist() == ROWS[0]["input_ids"]
    assert batch["input_ids"][0, 7:].tolist() == [PAD] * 7
    assert batch["loss_mask"][0].tolist() == [0.0] * 3 + [1.0] * 4 + [0.0] * 7
    check(batch, reference(ROWS))


@pytest.mark.parametrize("bs", [4, 8])
def test_block_alignment(bs):
    batch = DLLMCollator(PAD, EOS, block_size=bs)(ROWS)
    T = batch["input_ids"].shape[1]
    assert T % bs == 0 and T == 16
    # row 2 (cl=3): block fill with EOS up to the next multiple of bs, supervised, not attended
    fe = math.ceil(3 / bs) * bs
    assert batch["input_ids"][2, 3:fe].tolist() == [EOS] * (fe - 3)
    assert batch["loss_mask"][2, 3:fe].tolist() == [1.0] * (fe - 3)
    assert batch["attention_mask"][2, 3:].tolist() == [0] * (T - 3)
    # global pad beyond the fill: pad token, loss 0, attention 0
    assert batch["input_ids"][2, fe:].tolist() == [PAD] * (T - fe)
    assert batch["loss_mask"][2, fe:].sum() == 0
    check(batch, reference(ROWS, bs=bs))


def test_block_fill_uses_pad_without_eos():
    batch = DLLMCollator(PAD, None, block_size=4)([row(1, 2)])
    assert batch["input_ids"][0].tolist() == [10, 11, 12, PAD]
    assert batch["loss_mask"][0].tolist() == [0.0, 1.0, 1.0, 1.0]


def test_lcm_alignment():
    # bs=4, d=6 -> lcm 12: the longest fill (16) rounds up to 24
    batch = DLLMCollator(PAD, EOS, block_size=4, pad_seq_len_divisible=6)(ROWS)
    assert batch["input_ids"].shape[1] == 24
    check(batch, reference(ROWS, bs=4, d=6))
    # without a block size the divisor alone applies
    batch = DLLMCollator(PAD, EOS, pad_seq_len_divisible=5)(ROWS)
    assert batch["input_ids"].shape[1] == 15
    check(batch, reference(ROWS, d=5))


def test_max_seq_len_caps_and_truncates():
    batch = DLLMCollator(PAD, EOS, max_seq_len=10)(ROWS)
    assert batch["input_ids"].shape[1] == 10
    assert batch["input_ids"][1].tolist() == ROWS[1]["input_ids"][:10]  # content truncated
    assert batch["input_lengths"].tolist() == [7, 14, 3]  # unclamped
    check(batch, reference(ROWS, max_len=10))
    # with block alignment the cap still wins (fill end 12 > 10)
    batch = DLLMCollator(PAD, EOS, block_size=4, pad_seq_len_divisible=8, max_seq_len=10)(ROWS)
    assert batch["input_ids"].shape[1] == 10
    check(batch, reference(ROWS, bs=4, d=8, max_len=10))


def test_supervise_padding_only_affects_global_pad():
    off = DLLMCollator(PAD, EOS, block_size=4, supervise_padding=False)(ROWS)
    on = DLLMCollator(PAD, EOS, block_size=4, supervise_padding=True)(ROWS)
    check(on, reference(ROWS, bs=4, sup_pad=True))
    diff = (on["loss_mask"] != off["loss_mask"]).nonzero().tolist()
    fills = [8, 16, 4]
    assert diff and all(t >= fills[b] for b, t in diff)  # only the global pad changed
    assert torch.equal(on["input_ids"], off["input_ids"])
    assert torch.equal(on["attention_mask"], off["attention_mask"])
    # block fill supervised in both; content unaffected
    assert off["loss_mask"][2, 3:4].tolist() == [1.0]
    assert torch.equal(on["loss_mask"][0, :7], off["loss_mask"][0, :7])


def test_supervise_padding_no_effect_on_equal_lengths():
    rows = [row(2, 2), row(1, 3, start=50)]
    a = DLLMCollator(PAD, EOS, supervise_padding=True)(rows)
    b = DLLMCollator(PAD, EOS, supervise_padding=False)(rows)
    assert torch.equal(a["loss_mask"], b["loss_mask"])


def test_response_window_aligns_to_response_and_attends_fill():
    rows = [row(3, 2), row(6, 5, start=40)]
    batch = DLLMCollator(PAD, EOS, block_size=4, response_window=True)(rows)
    # row 0: prefix 3, cl 5 -> fill end 3 + 4 = 7; row 1: prefix 6, cl 11 -> 6 + 8 = 14
    assert batch["input_ids"].shape[1] == 14
    assert batch["attention_mask"][0].tolist() == [1] * 7 + [0] * 7
    assert batch["input_ids"][0, 5:7].tolist() == [EOS, EOS]
    check(batch, reference(rows, bs=4, window=True))


def test_single_turn_guard_runs_every_batch():
    collate = DLLMCollator(PAD, EOS, block_size=4, response_window=True)
    multi = {"input_ids": list(range(10, 18)), "loss_mask": [0, 1, 1, 0, 0, 1, 1, 0]}
    check(collate([row(2, 2)]), reference([row(2, 2)], bs=4, window=True))  # a valid batch first
    with pytest.raises(UserError, match="supervised runs"):
        collate([row(2, 2), multi])
    with pytest.raises(UserError, match="mask_history"):  # and again on a later batch
        collate([multi])
    # the base recipe has no such rule: the multi-turn row collates like any other
    check(DLLMCollator(PAD, EOS, block_size=4)([multi]), reference([multi], bs=4))


def test_supervised_runs():
    assert supervised_runs([0, 0]) == 0
    assert supervised_runs([1, 1, 0]) == 1
    assert supervised_runs([0, 1, 0, 1, 1, 0, 1]) == 3


def test_from_settings():
    from dllmflow.settings import load_settings

    class Tok:
        pad_token_id, eos_token_id = 7, 9

    s = load_settings(
        dllm={"mode": "mdlm", "pad_block_size": 4, "pad_seq_len_divisible": 8, "supervise_padding": True},
        dataset={"seq_length": 64},
    )
    c = DLLMCollator.from_settings(s, Tok())
    assert (c.pad_token_id, c.eos_token_id, c.block_size, c.pad_seq_len_divisible) == (7, 9, 4, 8)
    assert (c.max_seq_len, c.supervise_padding, c.response_window) == (64, True, False)
    s = load_settings(dllm={"mode": "block_diffusion", "vocab_size": 100})
    assert DLLMCollator.from_settings(s, Tok()).response_window
