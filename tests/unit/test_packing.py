"""Sequence packing (docs/strategies.md §1.8): the packed layout, the document mask, per-document noise,
and the whole training step of a packed batch against the same documents unpacked (mdlm, scdd): loss,
counts and every parameter's gradient; the modes that cannot pack are refused at settings load."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.data.collate import DLLMCollator
from dllmflow.data.pack import PackedCollator, build_collator, first_fit_decreasing
from dllmflow.diffusion.corruption import corrupt_scdd, corrupt_uniform, per_document, per_sample
from dllmflow.diffusion.seeding import sample_seed
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.errors import UserError
from dllmflow.models.doc_attention import check_packable, document_mask, forward_documents
from dllmflow.settings import SettingsError, load_settings
from dllmflow.training.data import GlobalBatches
from dllmflow.training.distributed import DistInfo
from dllmflow.training.step import train_step

INFO = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), distributed=False)
V, M, PAD, EOS, L = 48, 3, 0, 2, 64


class Tok:
    pad_token_id, eos_token_id = PAD, EOS


def _rows(n=13, seed=0, lengths=None):
    """Documents of variable length: an unsupervised prompt, then a supervised answer."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or torch.randint(4, 41, (n,), generator=g).tolist()
    rows = []
    for i, n_tok in enumerate(lengths):
        prompt = int(torch.randint(1, max(2, n_tok // 2), (1,), generator=g))
        ids = torch.randint(4, V, (n_tok,), generator=g).tolist()
        rows.append({"id": i, "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n_tok - prompt)})
    return rows


# ---- layout ---------------------------------------------------------------------------------------


def test_first_fit_decreasing_places_longest_first_into_the_first_bin_with_room():
    assert first_fit_decreasing([5, 9, 3, 6, 2], 10) == [[1], [3, 2], [0, 4]]
    assert first_fit_decreasing([], 10) == []


def test_packed_layout_positions_documents_and_block_fill():
    rows = _rows(lengths=[5, 9, 3, 6])
    collate = PackedCollator(PAD, EOS, block_size=4, max_seq_len=16)
    b = collate(rows)
    # fill ends 8, 12, 4, 8 -> first-fit decreasing: [12 | 4], [8 | 8]
    assert b["input_ids"].shape == (2, 16)
    assert b["document_index"].tolist() == [0, 1, 2, 3]
    assert b["document_ids"].tolist() == [[1] * 12 + [2] * 4, [0] * 8 + [3] * 8]
    assert b["position_ids"][0].tolist() == list(range(12)) + list(range(4))
    # doc 0 (5 tokens) in row 1: content attended, its 3-token fill supervised EOS, not attended
    assert b["input_ids"][1, :5].tolist() == rows[0]["input_ids"]
    assert b["input_ids"][1, 5:8].tolist() == [EOS] * 3
    assert b["attention_mask"][1, :8].tolist() == [1] * 5 + [0] * 3
    assert b["loss_mask"][1, :8].tolist() == rows[0]["loss_mask"] + [1.0] * 3
    assert b["input_lengths"].tolist() == [5, 9, 3, 6]
    assert int(b["packing_truncated"]) == int(b["packing_dropped"]) == 0


def test_overflow_is_truncated_like_the_unpacked_collator_or_dropped_and_counted():
    rows = _rows(lengths=[20, 6, 7])
    b = PackedCollator(PAD, EOS, block_size=8, max_seq_len=20)(rows)  # 20 -> fill end 24 > 20
    assert int(b["packing_truncated"]) == 1 and int(b["packing_dropped"]) == 0
    assert (b["document_ids"] == 0).sum() == 20  # cut at the sequence, as the unpacked cap cuts it
    unpacked = DLLMCollator(PAD, EOS, block_size=8, max_seq_len=20)([rows[0]])
    assert torch.equal(b["input_ids"][b["document_ids"] == 0], unpacked["input_ids"][0])
    d = PackedCollator(PAD, EOS, block_size=8, max_seq_len=20, overflow="drop")(rows)
    assert int(d["packing_dropped"]) == 1 and int(d["packing_truncated"]) == 0
    assert d["document_index"].tolist() == [1, 2] and d["input_ids"].shape == (1, 16)
    e = PackedCollator(PAD, EOS, max_seq_len=4, overflow="drop")(rows)  # nothing fits: one padding row
    assert e["document_index"].tolist() == [] and (e["document_ids"] == -1).all()


def test_packed_collator_refuses_supervised_padding():
    with pytest.raises(ValueError, match="supervise_padding"):
        PackedCollator(PAD, EOS, max_seq_len=16, supervise_padding=True)


def test_global_batches_hand_each_document_its_own_global_position():
    rows = _rows(n=10)
    gb = GlobalBatches(rows, PackedCollator(PAD, EOS, max_seq_len=L), 8, 4, 0, 1, seed=5)
    for mb, micro in zip(gb.step(2), range(2)):
        positions = gb.positions(2, micro)
        assert mb["global_index"].tolist() == positions  # documents in input order
        for n, p in enumerate(positions):  # document n holds the row at position p
            got = mb["input_ids"][mb["document_ids"] == n].tolist()
            want = rows[gb.row_index(p)]["input_ids"]
            assert got == want
    drop = GlobalBatches(rows, PackedCollator(PAD, EOS, max_seq_len=20, overflow="drop"), 4, 4, 0, 1, seed=5)
    mb = drop.step(0)[0]
    kept = [p for p in range(4) if len(rows[drop.row_index(p)]["input_ids"]) <= 20]
    assert mb["global_index"].tolist() == kept


# ---- attention --------------------------------------------------------------------------------------


def test_document_mask_is_block_diagonal_over_attended_keys():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    attn = torch.tensor([[1, 1, 0, 1, 1, 0]])  # position 2 is doc 0's block fill
    allowed = document_mask(doc, attn, torch.float32)[0, 0] == 0
    want = torch.tensor(
        [[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
         [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool,
    )  # fmt: skip
    assert torch.equal(allowed, want)


def _qwen3(seed=0, attn="sdpa"):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = attn
    return Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_document_does_not_see_its_neighbour(attn):
    model = _qwen3(attn=attn).eval()
    b = PackedCollator(PAD, EOS, max_seq_len=L)(_rows(lengths=[10, 12]))
    assert b["input_ids"].shape[0] == 1  # both in one sequence
    other = b["input_ids"].clone()
    other[b["document_ids"] == 0] = (other[b["document_ids"] == 0] + 1) % V  # change only doc 0
    args = (b["document_ids"], b["position_ids"], b["attention_mask"])
    seen = []  # the positions the rotary embedding is evaluated at: each document's own, from 0
    model.model.rotary_emb.register_forward_hook(lambda m, a, out: seen.append(a[1].clone()))
    with torch.no_grad():
        x, y = forward_documents(model, b["input_ids"], *args), forward_documents(model, other, *args)
    assert torch.equal(seen[0], b["position_ids"])
    assert b["position_ids"][0, 12].item() == 0  # doc 0 starts after doc 1, at position 0
    doc1 = b["document_ids"][0] == 1
    assert torch.equal(x[0, doc1], y[0, doc1])
    assert (x[0, ~doc1] - y[0, ~doc1]).abs().max() > 1e-4  # sanity: doc 0 itself did change


def test_a_natively_bidirectional_model_is_refused():
    model = torch.nn.Linear(1, 1)
    model.config = type("Cfg", (), {"model_type": "llada"})()
    with pytest.raises(UserError, match="dataset.packing"):
        check_packable(model)


# ---- noise -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kernel, kw",
    [
        (corrupt_uniform, {"mask_token_id": M, "eps": 1e-3}),
        (corrupt_scdd, {"mask_token_id": M, "vocab_size": V, "num_timesteps": 100, "uniform_ratio": 0.3}),
    ],
)
def test_each_document_draws_the_noise_of_its_unpacked_row(kernel, kw):
    rows = _rows(n=6, seed=1)
    seeds = [sample_seed(9, 0, 100 + i) for i in range(len(rows))]
    packed = PackedCollator(PAD, EOS, max_seq_len=L)(rows)
    unpacked = DLLMCollator(PAD, EOS, max_seq_len=L)(rows)
    assert packed["input_ids"].shape[0] < len(rows)  # it did pack
    got = per_document(kernel, seeds, packed["input_ids"], packed["loss_mask"], packed["document_ids"],
                       packed["position_ids"], draw_length=L, **kw)  # fmt: skip
    want = per_sample(kernel, seeds, unpacked["input_ids"], unpacked["loss_mask"], draw_length=L, **kw)
    for n in range(len(rows)):
        where = packed["document_ids"] == n
        for g, w in zip(got, want):
            assert torch.equal(g[where], w[n, : int(where.sum())])
    assert not got[1][packed["document_ids"] < 0].any()  # padding is never noise


# ---- the training step: packed == unpacked ----------------------------------------------------------


def _settings(mode, packing, **dllm):
    scdd = {"vocab_size": V, "num_timesteps": 100, "uniform_ratio": 0.3, "chunk_size": 16}
    extra = scdd if mode == "scdd" else {}
    return load_settings(
        dataset={"seq_length": L, "packing": packing},
        dllm={"mode": mode, "mask_token_id": M, **extra, **dllm},
        train={"global_batch_size": 8, "local_batch_size": 4, "seed": 11},
    )


def _step(mode, packing, rows, **dllm):
    settings = _settings(mode, packing, **dllm)
    t = settings.train
    batches = GlobalBatches(rows, build_collator(settings, Tok()), t.global_batch_size,
                            t.local_batch_size, 0, 1, t.seed)  # fmt: skip
    model = _qwen3(seed=3)
    no_autocast = torch.autocast("cpu", enabled=False)
    record = train_step(model, build_strategy(settings), batches, 2, settings, INFO, no_autocast)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return record, grads, batches


@pytest.mark.parametrize("mode, dllm", [("mdlm", {}), ("mdlm", {"pad_block_size": 8}), ("scdd", {})])
def test_packed_step_has_the_loss_and_gradients_of_the_unpacked_step(mode, dllm):
    rows = _rows(n=13, seed=2)
    (rec_u, grad_u, _), (rec_p, grad_p, packed) = (_step(mode, p, rows, **dllm) for p in (False, True))
    assert packed.step(2)[0]["input_ids"].shape[0] < 4  # it did pack
    assert rec_p["tokens_per_step"] < rec_u["tokens_per_step"]
    assert rec_p["supervised_tokens"] == rec_u["supervised_tokens"] > 0
    assert rec_p["packing_truncated"] == rec_p["packing_dropped"] == 0
    assert abs(rec_p["loss"] - rec_u["loss"]) <= 1e-6 and rec_u["loss"] > 0
    for k in grad_u:
        assert grad_u[k].abs().max() > 0, k  # every parameter is trained, so the comparison can fail
        torch.testing.assert_close(grad_p[k], grad_u[k], rtol=0, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# ---- settings ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dllm",
    [
        {"mode": "hybrid"},
        {"mode": "block_diffusion", "vocab_size": 100},
        {"mode": "dflash"},
        {"mode": "idlm", "mask_token_id": 3},
        {"mode": "mdlm", "supervise_padding": True},
    ],
)
def test_modes_that_cannot_pack_are_refused_naming_the_field(dllm):
    extra = {"dflash": {"target_model_id": "t"}} if dllm["mode"] == "dflash" else {}
    with pytest.raises(SettingsError, match=r"dataset\.packing"):
        load_settings(dataset={"packing": True}, dllm=dllm, **extra)
    load_settings(dataset={"packing": False}, dllm=dllm, **extra)  # the same settings load unpacked


def test_packable_modes_load_and_packing_stays_out_of_the_prepare_fingerprint():
    from dllmflow.data.prepared_dir import settings_used

    for mode in ("mdlm", "scdd"):
        assert _settings(mode, True).dataset.packing
    assert settings_used(_settings("mdlm", True)) == settings_used(_settings("mdlm", False))
