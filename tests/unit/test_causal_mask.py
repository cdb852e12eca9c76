"""The named causal mask (diffusion/masks/causal.py) against an independent `torch.tril` formula, and the
KV cache's row selection (samplers/kv.py `select_cache_rows`, transformers' `batch_select_indices`),
an emptied cache included.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_causal_mask.py
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from dllmflow.diffusion.masks.block_causal import block_causal_mask
from dllmflow.diffusion.masks.causal import causal_mask
from dllmflow.diffusion.samplers.kv import select_cache_rows


def _tril_reference(valid: torch.Tensor, q_start: int, q_len: int, dtype: torch.dtype) -> torch.Tensor:
    """keep = lower triangle (key <= query) over valid keys, plus the diagonal; rows [q_start, +q_len)."""
    K = valid.shape[1]
    lower = torch.ones(K, K, dtype=torch.bool).tril()  # [K, K]
    keep = (lower[None] & valid.bool()[:, None, :]) | torch.eye(K, dtype=torch.bool)[None]  # [B, K, K]
    keep = keep[:, q_start : q_start + q_len]  # [B, Q, K]
    low = torch.finfo(dtype).min
    return torch.where(keep, 0.0, low).to(dtype)[:, None]  # [B, 1, Q, K]


VALID = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1]])  # left padding


@pytest.mark.parametrize(("q_start", "q_len"), [(0, 7), (2, 5), (6, 1), (3, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_mask_is_the_lower_triangle_over_valid_keys(q_start, q_len, dtype):
    mask = causal_mask(VALID, dtype, q_start, q_len)
    assert mask.shape == (3, 1, q_len, 7) and mask.dtype == dtype
    assert torch.equal(mask, _tril_reference(VALID, q_start, q_len, dtype))


def test_causal_mask_defaults_to_every_query_and_blocks_padding_and_the_future():
    mask = causal_mask(VALID, torch.float32)  # [B, 1, K, K]
    assert torch.equal(mask, _tril_reference(VALID, 0, 7, torch.float32))
    low = torch.finfo(torch.float32).min
    assert mask[0, 0, 3, 4] == low and mask[0, 0, 4, 3] == 0  # the future blocked, the past kept
    assert mask[0, 0, 4, 1] == low and mask[0, 0, 1, 1] == 0  # a padded key blocked; its own diagonal kept


def test_causal_mask_is_block_causal_with_everything_prompt():
    """What the replaced spelling computed: block_causal_mask with prefix = every key, causal prefix."""
    K = VALID.shape[1]
    for q_start, q_len in [(0, K), (4, 3)]:
        old = block_causal_mask(VALID, K, 1, True, torch.float32, q_start, q_len)
        assert torch.equal(causal_mask(VALID, torch.float32, q_start, q_len), old)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=32)  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def _fill(model, cache: DynamicCache, ids: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)


def test_select_cache_rows_keeps_those_rows_of_every_layer(model):
    cache = DynamicCache(config=model.config)
    _fill(model, cache, torch.randint(0, 32, (3, 5)))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    select_cache_rows(cache, torch.tensor([2, 0]))
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys[[2, 0]]) and torch.equal(layer.values, values[[2, 0]])


def test_an_emptied_cache_takes_the_next_forwards_rows(model):
    """A cache cropped to length 0 (`cache: none`, a Fast-dLLM refresh) still holds layers of the old
    batch size; after a selection the next forward of fewer rows appends to it and computes what a fresh
    cache does."""
    cache = DynamicCache(config=model.config)
    _fill(model, cache, torch.randint(0, 32, (3, 5)))
    cache.crop(-5)
    assert cache.get_seq_length() == 0
    select_cache_rows(cache, torch.tensor([1]))
    ids = torch.randint(0, 32, (1, 4))
    with torch.no_grad():
        got = model(input_ids=ids, cache=cache, use_cache=True).logits
        fresh = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True).logits
    assert cache.get_seq_length() == 4 and torch.equal(got, fresh)
