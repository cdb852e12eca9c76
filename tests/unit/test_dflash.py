"""DFlash strategy: layer ids, decay weights, loss vs a direct reference, fused == dense, draft
accuracy (incl. the cross-rank reduction), anchor samplers, mask id resolution, errors, frozen
target, export of the draft only."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from _dflash_common import NUM_WORDS, make_batch, make_settings, make_strategy, make_tokenizer
from safetensors import safe_open

from dllmflow.diffusion.dflash_blocks import (
    build_block_inputs,
    sample_anchor_blocks,
    sample_anchors_disjoint,
    sample_anchors_overlap,
)
from dllmflow.diffusion.dflash_loss import (
    accuracy_sums,
    decay_ce_dense,
    decay_ce_fused,
    decay_weights,
    draft_accuracy,
    resolve_gamma,
)
from dllmflow.diffusion.modes import build_mode_model
from dllmflow.diffusion.strategies import build_strategy
from dllmflow.errors import UserError
from dllmflow.models.dflash_draft import DFlashDraftModel, build_target_layer_ids, load_draft
from dllmflow.models.dflash_target import resolve_block_size
from dllmflow.settings.loader import SettingsError


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dflash") / "target"


@pytest.fixture(scope="module")
def setup_n3(target_dir):
    return make_strategy(target_dir, block_size=4, num_blocks_per_sample=3, use_fused_linear_ce=False)


# ---- configuration helpers ------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "m", "ids"), [(12, 1, [6]), (12, 3, [1, 5, 9]), (36, 5, [1, 9, 17, 25, 33])])
def test_target_layer_ids(n, m, ids):
    assert build_target_layer_ids(n, m) == ids


@pytest.mark.parametrize(("bs", "gamma"), [(16, 7), (10, 5), (8, 4)])
def test_paper_gamma_and_first_offset_weight_is_one(bs, gamma):
    assert resolve_gamma(0.0, bs) == gamma
    w = decay_weights(bs, resolve_gamma(0.0, bs))
    assert w.shape == (bs - 1,) and w[0].item() == 1.0
    assert torch.all(w[1:] < w[:-1])  # monotone decreasing
    torch.testing.assert_close(w, torch.tensor([math.exp(-(k - 1) / gamma) for k in range(1, bs)]))


def test_gamma_fallback_and_explicit():
    assert resolve_gamma(0.0, 12) == 6.0 and resolve_gamma(0.0, 2) == 2.0 and resolve_gamma(3.5, 16) == 3.5


# ---- loss ---------------------------------------------------------------------------------------


def reference_decay_loss(logits, targets, mask, bs, gamma):
    """Loops: Σ_{b,n,k} exp(-(k-1)/γ)·mask·(-log softmax(logits)[target]), k restarting every block."""
    total, logits = 0.0, logits.detach()
    for b in range(logits.shape[0]):
        for p in range(logits.shape[1]):
            k = p % (bs - 1) + 1
            nll = -torch.log_softmax(logits[b, p].double(), -1)[targets[b, p]]
            total += math.exp(-(k - 1) / gamma) * float(mask[b, p]) * float(nll)
    return total


def test_decay_ce_matches_reference_with_per_block_reset():
    g = torch.Generator().manual_seed(0)
    bs, n_blocks, d, vocab = 4, 3, 8, 11
    head = torch.nn.Linear(d, vocab)
    hidden = torch.randn(2, n_blocks * (bs - 1), d, generator=g)
    targets = torch.randint(0, vocab, (2, n_blocks * (bs - 1)), generator=g)
    mask = (torch.rand(2, n_blocks * (bs - 1), generator=g) > 0.3).float()
    weights = decay_weights(bs, 2.0).repeat(n_blocks)
    loss, correct = decay_ce_dense(hidden, head, targets, mask, weights)
    ref = reference_decay_loss(head(hidden), targets, mask, bs, 2.0)
    assert abs(loss.item() - ref) < 1e-4
    assert torch.equal(correct, (head(hidden).argmax(-1) == targets).float() * mask)


def test_fused_equals_dense_loss_counts_and_grads():
    g = torch.Generator().manual_seed(1)
    bs, n_blocks, d, vocab = 5, 4, 8, 13
    head = torch.nn.Linear(d, vocab).requires_grad_(False)
    h0 = torch.randn(3, n_blocks * (bs - 1), d, generator=g)
    targets = torch.randint(0, vocab, h0.shape[:2], generator=g)
    mask = (torch.rand(h0.shape[:2], generator=g) > 0.4).float()
    weights = decay_weights(bs, 2.5).repeat(n_blocks)
    ha, hb = h0.clone().requires_grad_(), h0.clone().requires_grad_()
    la, ca = decay_ce_dense(ha, head, targets, mask, weights)
    lb, cb = decay_ce_fused(hb, head, targets, mask, weights, chunk_size=7)
    torch.testing.assert_close(lb, la)
    assert torch.equal(cb, ca)
    assert accuracy_sums(ca, mask, bs).keys() == accuracy_sums(cb, mask, bs).keys()
    la.backward(), lb.backward()
    torch.testing.assert_close(hb.grad, ha.grad)


def test_strategy_loss_matches_direct_reference(setup_n3):
    """End to end against docs/strategies.md §2.5 written out position by position: keep, block inputs, targets and
    their mask from the clean ids and the sampled anchors, the draft's attention mask and positions
    element-wise, then the loop loss on the draft's own logits (float64), to 1e-5."""
    strategy, draft = setup_n3
    batch = make_batch(bsz=2, seq_len=24, seed=3)
    batch.update(strategy.corrupt(batch, [11, 12]))
    out = strategy.loss(draft, batch)
    bs, seq_len, mask_id = strategy.block_size, 24, strategy.mask_token_id
    ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    anchors = batch["dflash_anchors"]
    num_blocks = anchors.shape[1]
    # 1) pre-step from docs/strategies.md §2.5: keep, block ids, targets and target mask
    keep = torch.zeros(2, num_blocks, dtype=torch.bool)
    block_ids = torch.full((2, num_blocks * bs), mask_id)
    targets = torch.zeros(2, num_blocks * (bs - 1), dtype=torch.long)
    tmask = torch.zeros(2, num_blocks * (bs - 1))
    for b in range(2):
        valid = int(attn[b].sum())
        sup = float((attn[b] * lm[b]).sum())
        for n in range(num_blocks):
            a = int(anchors[b, n])
            assert 1 <= a <= max(valid - bs, 1)
            keep[b, n] = sup >= 2 * bs and valid > bs
            if keep[b, n]:
                block_ids[b, n * bs] = ids[b, a]
            for k in range(1, bs):
                p = min(a + k, seq_len - 1)
                targets[b, n * (bs - 1) + k - 1] = ids[b, p]
                ok = bool(keep[b, n]) and a + k < valid and attn[b, p] * lm[b, p] > 0
                tmask[b, n * (bs - 1) + k - 1] = float(ok)
    assert torch.equal(batch["dflash_keep"], keep) and keep.any() and tmask.sum() > 0
    # 2) the draft forward with an element-wise mask and positions
    with torch.no_grad():
        hs = strategy.target.model(
            input_ids=ids, attention_mask=attn, output_hidden_states=True
        ).hidden_states
        h = torch.cat([hs[i + 1] for i in strategy.layer_ids], -1)
        noise = strategy.target_embed(block_ids)
    q_len = num_blocks * bs
    mask = torch.full((2, 1, q_len, seq_len + q_len), torch.finfo(torch.float32).min)
    pos = torch.zeros(2, seq_len + q_len, dtype=torch.long)
    for b in range(2):
        pos[b, :seq_len] = torch.arange(seq_len)
        for q in range(q_len):
            n = q // bs
            pos[b, seq_len + q] = anchors[b, n] + q % bs
            for kv in range(seq_len + q_len):
                ok = (kv < anchors[b, n] and bool(keep[b, n])) if kv < seq_len else (kv - seq_len) // bs == n
                if ok:
                    mask[b, 0, q, kv] = 0.0
    with torch.no_grad():
        hidden = draft(target_hidden=h, noise_embedding=noise, position_ids=pos, attention_mask=mask)
        logits = strategy.target_head(
            hidden.view(2, -1, bs, hidden.shape[-1])[:, :, 1:].reshape(2, -1, hidden.shape[-1])
        )
    ref = reference_decay_loss(logits, targets, tmask, bs, strategy.gamma)
    assert math.isclose(out.sums["diffusion"].item(), ref, rel_tol=1e-5)
    assert strategy.token_counts(batch)["diffusion"].item() == tmask.sum().item()


def test_strategy_fused_equals_dense(target_dir):
    batch = make_batch(bsz=2, seq_len=24, seed=4)
    results = []
    for fused in (False, True):
        strategy, draft = make_strategy(
            target_dir, block_size=4, num_blocks_per_sample=2, use_fused_linear_ce=fused, ce_chunk_size=3
        )
        b = dict(batch)
        b.update(strategy.corrupt(b, [5, 6]))
        out = strategy.loss(draft, b)
        out.sums["diffusion"].backward()
        results.append((out, draft.fc.weight.grad.clone()))
    (dense, g_dense), (fused, g_fused) = results
    torch.testing.assert_close(fused.sums["diffusion"], dense.sums["diffusion"])
    assert {k: v.item() for k, v in fused.metric_sums.items()} == {
        k: v.item() for k, v in dense.metric_sums.items()
    }
    torch.testing.assert_close(g_fused, g_dense)
    assert torch.isfinite(g_dense).all() and g_dense.abs().sum() > 0


# ---- draft accuracy -----------------------------------------------------------------------------


def test_perfect_predictions_give_full_counts_and_masked_positions_are_excluded():
    bs, n_blocks, vocab = 4, 2, 6
    head = torch.nn.Linear(vocab, vocab, bias=False)
    head.weight.data = torch.eye(vocab) * 10
    targets = torch.tensor([[0, 1, 2, 3, 4, 5]])
    mask = torch.tensor([[1.0, 1, 0, 1, 0, 1]])
    hidden = F.one_hot(targets, vocab).float()
    _, correct = decay_ce_dense(hidden, head, targets, mask, decay_weights(bs, 2.0).repeat(n_blocks))
    sums = accuracy_sums(correct, mask, bs)
    assert [sums[f"draft_count_k{k}"].item() for k in (1, 2, 3)] == [2.0, 1.0, 1.0]
    assert [sums[f"draft_correct_k{k}"].item() for k in (1, 2, 3)] == [2.0, 1.0, 1.0]
    assert draft_accuracy({k: v.item() for k, v in sums.items()}) == {
        "draft_acc": 1.0,
        "draft_acc_k1": 1.0,
        "draft_acc_k2": 1.0,
        "draft_acc_k3": 1.0,
    }


def test_sum_then_divide_across_two_ranks_gives_global_accuracy():
    rank0 = {"draft_correct_k1": 9.0, "draft_count_k1": 10.0, "draft_correct_k2": 0.0, "draft_count_k2": 0.0}
    rank1 = {"draft_correct_k1": 0.0, "draft_count_k1": 2.0, "draft_correct_k2": 1.0, "draft_count_k2": 4.0}
    summed = {k: rank0[k] + rank1[k] for k in rank0}
    acc = draft_accuracy(summed)
    assert acc["draft_acc"] == pytest.approx(10 / 16)
    assert acc["draft_acc_k1"] == pytest.approx(9 / 12) and acc["draft_acc_k2"] == pytest.approx(1 / 4)
    mean_of_ranks = (draft_accuracy(rank0)["draft_acc"] + draft_accuracy(rank1)["draft_acc"]) / 2
    assert acc["draft_acc"] != pytest.approx(mean_of_ranks)


def test_draft_accuracy_is_logged_for_a_single_block(target_dir):
    strategy, draft = make_strategy(target_dir, block_size=4, num_blocks_per_sample=1)
    batch = make_batch(seed=5)
    batch.update(strategy.corrupt(batch, [1, 2]))
    out = strategy.loss(draft, batch)
    metrics = strategy.finalize_metrics({k: v.item() for k, v in out.metric_sums.items()})
    assert set(metrics) == {"draft_acc", "draft_acc_k1", "draft_acc_k2", "draft_acc_k3"}
    assert (
        sum(out.metric_sums[f"draft_count_k{k}"].item() for k in (1, 2, 3))
        == batch["dflash_target_mask"].sum().item()
    )


# ---- anchor sampling ----------------------------------------------------------------------------


def test_overlap_anchors_range_and_more_blocks_than_fit():
    for seed in range(20):
        a = sample_anchors_overlap(
            valid_len=16, num_blocks=20, block_size=4, gen=torch.Generator().manual_seed(seed)
        )
        assert a.shape == (20,) and a.min() >= 1 and a.max() <= 12  # N=20 > L/bs=4


@pytest.mark.parametrize(("valid", "bs"), [(16, 4), (30, 8), (5, 4), (3, 4), (6, 4)])
def test_overlap_anchors_are_the_spec_draw(valid, bs):
    """docs/strategies.md §2.5: a = min(max(1 + round(U (M-1)), 1), M), M = max(valid - bs, 1), U from the sample's
    generator (float32 rand). Not randint(1, M+1): the two ends get half the inner weight."""
    M = max(valid - bs, 1)
    for seed in range(10):
        a = sample_anchors_overlap(valid_len=valid, num_blocks=64, block_size=bs,
                                   gen=torch.Generator().manual_seed(seed))  # fmt: skip
        u = torch.rand(64, generator=torch.Generator().manual_seed(seed)).tolist()
        want = [min(max(1 + round(x * (M - 1)), 1), M) for x in u]  # Python round: half to even
        assert a.tolist() == want


def test_overlap_anchor_ends_get_half_the_weight():
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors_overlap(valid_len=9, num_blocks=40000, block_size=4, gen=gen)  # M = 5
    freq = torch.bincount(a, minlength=6)[1:].double() / a.numel()
    # 1 + round(U·4): 1 and 5 with prob. 1/8, 2..4 with prob. 1/4 (randint would give 1/5 each)
    torch.testing.assert_close(freq, torch.tensor([1 / 8, 1 / 4, 1 / 4, 1 / 4, 1 / 8], dtype=torch.double),
                               atol=0.01, rtol=0)  # fmt: skip


@pytest.mark.parametrize(("valid", "n_blocks", "bs"), [(30, 5, 4), (40, 3, 8), (13, 2, 4), (20, 1, 4)])
def test_disjoint_anchors_are_the_spec_draw_when_it_fits(valid, n_blocks, bs):
    """docs/strategies.md §2.5 legacy sampler: n = min(N, max(1, (v-1)//bs)), avail = v - n·bs >= n here, starts =
    sort(randperm(avail)[:n]) + arange(n)·bs + 1, padded to N with the last start."""
    n = min(n_blocks, max(1, (valid - 1) // bs))
    avail = valid - n * bs
    assert avail >= n
    for seed in range(10):
        a, n_valid = sample_anchors_disjoint(valid, n_blocks, bs, torch.Generator().manual_seed(seed))
        perm = torch.randperm(avail, generator=torch.Generator().manual_seed(seed))
        want = sorted(perm[:n].tolist())
        want = [c + i * bs + 1 for i, c in enumerate(want)]
        assert n_valid == n and a.tolist() == want + [want[-1]] * (n_blocks - n)


def test_anchor_sampling_is_seeded_per_sample_and_leaves_global_rng_alone():
    attn = torch.ones(3, 30, dtype=torch.long)
    loss_mask = torch.ones(3, 30)
    from dllmflow.diffusion.seeding import generators

    state = torch.get_rng_state()
    a1, _ = sample_anchor_blocks(attn, loss_mask, 4, 8, True, generators([1, 2, 3]))
    a2, _ = sample_anchor_blocks(attn[:2], loss_mask[:2], 4, 8, True, generators([9, 2]))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a1[1], a2[1])  # same seed -> same anchors, whatever else is in the batch
    assert not torch.equal(a1[0], a1[2])


@pytest.mark.parametrize(("valid", "n_blocks"), [(14, 3), (30, 5), (17, 16), (9, 2)])
def test_disjoint_anchors_do_not_overlap_and_fit(valid, n_blocks):
    bs = 4
    for seed in range(25):
        a, n_valid = sample_anchors_disjoint(valid, n_blocks, bs, torch.Generator().manual_seed(seed))
        assert a.shape == (n_blocks,) and n_valid == min(n_blocks, (valid - 1) // bs)
        starts = a[:n_valid]
        assert starts.min() >= 1 and (starts + bs).max() <= valid
        assert torch.all(starts[1:] - starts[:-1] >= bs)
        assert torch.all(a[n_valid:] == starts[-1])


def test_disjoint_sampler_survives_the_legacy_shape_error():
    # valid 14, bs 4, N 3: legacy avail = 14 - 12 = 2 < n_valid = 3 made randperm(avail)[:3] too short.
    seen = set()
    for seed in range(40):
        a, n_valid = sample_anchors_disjoint(14, 3, 4, torch.Generator().manual_seed(seed))
        assert n_valid == 3
        seen.add(tuple(a.tolist()))
    assert seen == {(1, 5, 9), (1, 5, 10), (1, 6, 10), (2, 6, 10)}  # every placement reachable


def test_disjoint_padding_blocks_are_dropped(setup_n3):
    from dllmflow.diffusion.seeding import generators

    attn, loss_mask = torch.ones(1, 9, dtype=torch.long), torch.ones(1, 9)
    _, keep = sample_anchor_blocks(attn, loss_mask, 4, 3, False, generators([0]))
    assert keep.tolist() == [[True, True, False]]


def test_short_samples_are_skipped():
    from dllmflow.diffusion.seeding import generators

    attn = torch.ones(3, 20, dtype=torch.long)
    attn[2, 4:] = 0  # valid length 4 = bs
    loss_mask = torch.zeros(3, 20)
    loss_mask[0, 10:] = 1  # 10 supervised >= 2·bs
    loss_mask[1, 13:] = 1  # 7 < 2·bs
    loss_mask[2, :] = 1
    for overlap in (True, False):
        anchors, keep = sample_anchor_blocks(attn, loss_mask, 4, 2, overlap, generators([1, 2, 3]))
        assert keep[0].any() and not keep[1].any() and not keep[2].any()
        _, _, tmask = build_block_inputs(
            torch.zeros(3, 20, dtype=torch.long), attn, loss_mask, anchors, keep, 4, 99
        )
        assert tmask[1:].sum() == 0


def test_block_inputs_clean_anchor_mask_slots_and_supervision():
    ids = torch.arange(100, 120)[None]
    attn = torch.ones(1, 20, dtype=torch.long)
    attn[0, 18:] = 0
    loss_mask = torch.zeros(1, 20)
    loss_mask[0, 8:] = 1
    anchors, keep = torch.tensor([[6, 15, 3]]), torch.tensor([[True, True, False]])
    block_ids, targets, tmask = build_block_inputs(ids, attn, loss_mask, anchors, keep, 4, mask_id=7)
    assert block_ids.tolist() == [[106, 7, 7, 7, 115, 7, 7, 7, 7, 7, 7, 7]]
    assert targets[0, :6].tolist() == [107, 108, 109, 116, 117, 118]
    # block 0: 7 is prompt (loss 0), 8 and 9 supervised; block 1: 18 is padding; block 2 dropped
    assert tmask.tolist() == [[0, 1, 1, 1, 1, 0, 0, 0, 0]]


# ---- setup, mask id, errors ---------------------------------------------------------------------


def test_setup_resolves_and_freezes_the_target(setup_n3):
    strategy, draft = setup_n3
    assert strategy.block_size == 4 and strategy.gamma == 2.0
    assert strategy.layer_ids == build_target_layer_ids(strategy.target.config.num_hidden_layers, 1)
    assert not strategy.target.training
    assert not any(p.requires_grad for p in strategy.target.parameters())
    batch = make_batch(seed=7)
    batch.update(strategy.corrupt(batch, [3, 4]))
    strategy.loss(draft, batch).sums["diffusion"].backward()
    assert all(p.grad is None for p in strategy.target.parameters())
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in draft.parameters() if p.requires_grad
    )


def test_mask_id_resolution(tmp_path):
    target = tmp_path / "target"
    tok = make_tokenizer(with_mask=True)
    draft = build_mode_model(make_settings(target, dllm={"mask_token_id": 3}), tok)
    assert draft.config.mask_token_id == 3  # settings first
    draft = build_mode_model(make_settings(target), make_tokenizer(with_mask=True))
    assert draft.config.mask_token_id == NUM_WORDS + 2  # then the tokenizer's mask
    bare = make_tokenizer(with_mask=False)
    draft = build_mode_model(make_settings(target), bare)
    assert (
        draft.config.mask_token_id == NUM_WORDS + 2
    )  # then the target's tokenizer (saved with the tiny target)
    assert bare.mask_token_id is None


def test_mask_token_added_when_nobody_has_one(tmp_path):
    tok = make_tokenizer(with_mask=False)
    strategy, draft = make_strategy(tmp_path / "target", tokenizer=tok)
    assert tok.mask_token == "<|MASK|>" and strategy.mask_token_id == tok.mask_token_id == NUM_WORDS + 2
    # The target has no row for it (vocab built before), so the draft owns the mask embedding.
    assert strategy.target_embed.weight.shape[0] == NUM_WORDS + 2 and draft.config.own_mask_embedding
    batch = make_batch(seed=8)
    batch.update(strategy.corrupt(batch, [1, 2]))
    strategy.loss(draft, batch).sums["diffusion"].backward()
    assert draft.mask_embedding.grad.abs().sum() > 0


def test_missing_target_and_bad_backend_are_settings_errors(tmp_path):
    with pytest.raises(SettingsError, match="target_model_id"):
        make_settings(tmp_path, target_model_id="")
    with pytest.raises(SettingsError, match="attention_backend"):
        make_settings(tmp_path, attention_backend="flash")
    with pytest.raises(SettingsError, match="block_size"):
        make_settings(tmp_path, block_size=1)


def test_strategy_rejects_unvalidated_bad_input(tmp_path):
    settings = make_settings(tmp_path / "target")
    with pytest.raises(UserError, match="target_model_id"):
        build_strategy(settings.model_copy(update={"dflash": None}))
    bad = settings.dflash.model_copy(update={"attention_backend": "flash"})
    with pytest.raises(UserError, match="attention_backend"):
        build_strategy(settings.model_copy(update={"dflash": bad}))
    flex = settings.dflash.model_copy(update={"attention_backend": "flex_attention"})
    strategy = build_strategy(settings.model_copy(update={"dflash": flex}))
    tok = make_tokenizer()
    with pytest.raises(UserError, match="CUDA"):
        strategy.setup(build_mode_model(strategy.settings, tok), tok, torch.device("cpu"))


def test_block_size_unresolvable_or_too_small(tmp_path):
    with pytest.raises(UserError, match="block_size"):
        build_mode_model(make_settings(tmp_path / "target", block_size=0), make_tokenizer())
    with pytest.raises(UserError, match="block_size"):
        resolve_block_size(0, torch.nn.Linear(1, 1))
    draft = torch.nn.Linear(1, 1)
    draft.block_size = 1
    with pytest.raises(UserError, match="< 2"):
        resolve_block_size(0, draft)
    draft.block_size = 16
    assert resolve_block_size(0, draft) == 16 and resolve_block_size(8, draft) == 8


# ---- export -------------------------------------------------------------------------------------


def test_export_holds_only_the_draft_and_loads_back(setup_n3, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    strategy, draft = setup_n3
    out = tmp_path / "export"
    strategy.export(
        draft, {k: v.detach().clone() for k, v in draft.state_dict().items()}, make_tokenizer(), out
    )
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert keys == set(draft.state_dict())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["target_layer_ids"] == strategy.layer_ids
    assert cfg["mask_token_id"] == strategy.mask_token_id and cfg["target_model_id"].startswith("tiny:")
    loaded = AutoModel.from_pretrained(out)
    assert isinstance(loaded, DFlashDraftModel)
    h, noise, pos = (
        torch.randn(1, 5, draft.fc.in_features),
        torch.randn(1, 4, draft.config.hidden_size),
        torch.arange(9)[None],
    )
    torch.testing.assert_close(loaded(h, noise, pos), draft(h, noise, pos))
    assert AutoTokenizer.from_pretrained(out).mask_token_id == strategy.mask_token_id


def test_published_draft_layout_loads_without_remote_code(setup_n3, tmp_path):
    """A z-lab style dir (model_type qwen3, auto_map, dflash_config) loads into our class when
    trust_remote_code is off, reading block size, layer ids and mask id from its config."""
    _, draft = setup_n3
    draft.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("block_size", "target_layer_ids", "mask_token_id", "target_model_id", "own_mask_embedding"):
        cfg.pop(key, None)
    cfg.update(
        model_type="qwen3",
        architectures=["DFlashDraftModel"],
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=16,
        dflash_config={"mask_token_id": 5, "target_layer_ids": draft.target_layer_ids},
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_draft(tmp_path, trust_remote_code=False)
    assert isinstance(loaded, DFlashDraftModel)
    assert (
        loaded.block_size == 16
        and loaded.mask_token_id == 5
        and loaded.target_layer_ids == draft.target_layer_ids
    )
    torch.testing.assert_close(loaded.fc.weight, draft.fc.weight)
