"""Bidirectional 4D masks on a standard HF decoder (Qwen3): later tokens reach earlier positions,
padded keys reach nobody, and no row is ever fully blocked."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dllmflow.models.attention import bidirectional_mask, forward_bidirectional


def test_mask_values_and_shape():
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    mask = bidirectional_mask(am, torch.float32)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.float32
    low = torch.finfo(torch.float32).min
    expected = torch.zeros(2, 1, 4, 4)
    expected[0, 0, :, 3] = low  # padded key blocked for every query...
    expected[0, 0, 3, 3] = 0.0  # ...except its own diagonal, so its row is not empty
    assert torch.equal(mask, expected)


def test_no_mask_means_all_visible():
    mask = bidirectional_mask(None, torch.bfloat16, batch=2, length=3)
    assert mask.shape == (2, 1, 3, 3) and mask.dtype == torch.bfloat16 and (mask == 0).all()
    with pytest.raises(ValueError):
        bidirectional_mask(None, torch.float32)


@pytest.fixture(params=["sdpa", "eager"])
def model(request):
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, head_dim=8, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = request.param
    return Qwen3ForCausalLM(cfg).eval()


def test_later_token_changes_earlier_logits(model):
    x = torch.randint(0, 40, (1, 10), generator=torch.Generator().manual_seed(1))
    later = x.clone()
    later[0, 7] = (later[0, 7] + 1) % 40
    with torch.no_grad():
        a = forward_bidirectional(model, x)
        b = forward_bidirectional(model, later)
        causal_a, causal_b = model(x).logits, model(later).logits
    assert (a[0, 2] - b[0, 2]).abs().max() > 1e-4  # bidirectional: position 2 sees position 7
    assert torch.equal(causal_a[0, 2], causal_b[0, 2])  # sanity: the plain causal call does not


def test_padded_keys_do_not_change_real_positions(model):
    x = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, 6:] = 0
    other = x.clone()
    other[1, 6:] = (other[1, 6:] + 5) % 40  # change only padded tokens
    with torch.no_grad():
        a = forward_bidirectional(model, x, am)
        b = forward_bidirectional(model, other, am)
    torch.testing.assert_close(a[1, :6], b[1, :6], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert torch.isfinite(a).all()  # padded query rows keep their diagonal: no NaN


def test_natively_bidirectional_families_get_no_mask():
    # LLaDA-style remote code (not runnable offline) is bidirectional already and reads a 2D mask
    # its own way: forward_bidirectional passes it none, as the reference recipe does.
    class FakeLLaDA(torch.nn.Module):
        config = type("Cfg", (), {"model_type": "llada"})()

        def forward(self, input_ids, **kwargs):
            self.kwargs = kwargs
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 5)})()

    fake = FakeLLaDA()
    logits = forward_bidirectional(fake, torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3))
    assert logits.shape == (2, 3, 5) and fake.kwargs == {}
