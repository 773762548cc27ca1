"""The worker's tiny transformer: deterministic; chunked prefill over cached KV equals one pass."""

from __future__ import annotations

import pytest
import torch

from kvmesh.config import ModelConfig
from kvmesh.errors import ConfigError, InvalidInput
from kvmesh.worker.model import TinyTransformer

CFG = ModelConfig(num_layers=2)
PAGE = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CFG)


def _prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist()


def test_two_instances_have_identical_weights_and_outputs(model: TinyTransformer) -> None:
    other = TinyTransformer(CFG)
    assert torch.equal(model.embed, other.embed)
    assert torch.equal(model.lm_head, other.lm_head)
    for a, b in zip(model.layers, other.layers, strict=True):
        assert torch.equal(a.wqkv, b.wqkv) and torch.equal(a.w_down, b.w_down)
    prompt = _prompt(70)
    logits_a, kv_a = model.prefill(prompt)
    logits_b, kv_b = other.prefill(prompt)
    assert torch.equal(logits_a, logits_b) and torch.equal(kv_a, kv_b)
    assert model.generate(prompt, 12) == other.generate(prompt, 12)


def test_a_different_seed_gives_a_different_model(model: TinyTransformer) -> None:
    other = TinyTransformer(ModelConfig(num_layers=2, seed=CFG.seed + 1))
    assert not torch.equal(model.embed, other.embed)


def test_prefill_returns_last_logits_and_kv_of_every_new_token(model: TinyTransformer) -> None:
    logits, kv = model.prefill(_prompt(37))
    assert logits.shape == (CFG.vocab_size,) and logits.dtype == torch.float32
    assert kv.shape == (CFG.num_layers, 2, 37, CFG.num_kv_heads, CFG.head_dim)
    assert torch.isfinite(kv).all() and torch.isfinite(logits).all()


def test_page_by_page_prefill_over_cached_kv_equals_the_whole_prompt(
    model: TinyTransformer,
) -> None:
    prompt = _prompt(5 * PAGE + 7)
    whole_logits, whole_kv = model.prefill(prompt)
    past: torch.Tensor | None = None
    logits = whole_logits
    for start in range(0, len(prompt), PAGE):
        logits, new_kv = model.prefill(prompt[start : start + PAGE], past, start)
        past = new_kv if past is None else torch.cat((past, new_kv), dim=2)
    assert past is not None
    torch.testing.assert_close(past, whole_kv, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, whole_logits, atol=ATOL, rtol=0)
    assert int(logits.argmax()) == int(whole_logits.argmax())


def test_prefill_into_a_buffer_matches_prefill_and_leaves_the_past_untouched(
    model: TinyTransformer,
) -> None:
    prompt = _prompt(3 * PAGE)
    _, whole_kv = model.prefill(prompt)
    buf = model.empty_kv(len(prompt) + 4)
    model.prefill_into(buf, 0, prompt[: 2 * PAGE])
    past_before = buf[:, :, : 2 * PAGE].clone()
    model.prefill_into(buf, 2 * PAGE, prompt[2 * PAGE :])
    assert torch.equal(buf[:, :, : 2 * PAGE], past_before)
    torch.testing.assert_close(buf[:, :, : len(prompt)], whole_kv, atol=ATOL, rtol=0)


def test_chunked_generation_gives_the_same_greedy_tokens(model: TinyTransformer) -> None:
    prompt = _prompt(4 * PAGE + 3, seed=5)
    expected = model.generate(prompt, 16)
    buf = model.empty_kv(len(prompt) + 15)
    logits = torch.empty(0)
    for start in range(0, len(prompt), PAGE):
        logits = model.prefill_into(buf, start, prompt[start : start + PAGE])
    assert model.generate_from(logits, buf, len(prompt), 16) == expected


def test_greedy_decode_is_the_argmax_of_a_full_recompute(model: TinyTransformer) -> None:
    prompt = _prompt(40, seed=2)
    tokens = model.generate(prompt, 6)
    assert len(tokens) == 6 and all(0 <= t < CFG.vocab_size for t in tokens)
    seq = list(prompt)
    for tok in tokens:
        logits, _ = model.prefill(seq)
        assert int(logits.argmax()) == tok
        seq.append(tok)


def test_decode_asked_to_stop_ends_early_with_the_tokens_decoded_so_far(
    model: TinyTransformer,
) -> None:
    prompt = _prompt(20, seed=7)
    expected = model.generate(prompt, 12)
    asked = 0

    def stop_after_four_steps() -> bool:
        nonlocal asked
        asked += 1
        return asked > 4

    buf = model.empty_kv(len(prompt) + 11)
    logits = model.prefill_into(buf, 0, prompt)
    first = int(logits.argmax())
    rest, _ = model.decode(first, buf, len(prompt), 11, stop=stop_after_four_steps)
    assert [first, *rest] == expected[:5]
    assert asked == 5  # asked before every step, and no step ran after the first yes


def test_generate_zero_tokens_returns_nothing(model: TinyTransformer) -> None:
    assert model.generate(_prompt(5), 0) == []


def test_different_prompts_give_different_answers(model: TinyTransformer) -> None:
    answers = {tuple(model.generate(_prompt(33, seed=s), 8)) for s in range(4)}
    assert len(answers) > 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_models_keep_their_dtype(dtype: str) -> None:
    m = TinyTransformer(ModelConfig(num_layers=1, dtype=dtype))
    _, kv = m.prefill(_prompt(20))
    assert kv.dtype == getattr(torch, dtype)
    assert len(m.generate(_prompt(20), 3)) == 3


def test_bad_tokens_are_rejected_with_the_valid_range(model: TinyTransformer) -> None:
    with pytest.raises(InvalidInput, match=r"\[0, 256\)"):
        model.prefill([1, 256])
    with pytest.raises(InvalidInput, match="non-empty"):
        model.prefill([])


def test_start_pos_must_match_the_past(model: TinyTransformer) -> None:
    _, kv = model.prefill(_prompt(8))
    with pytest.raises(InvalidInput, match="start_pos"):
        model.prefill(_prompt(4), kv, start_pos=3)


def test_a_too_small_buffer_is_rejected(model: TinyTransformer) -> None:
    buf = model.empty_kv(10)
    with pytest.raises(InvalidInput, match="10 positions"):
        model.prefill_into(buf, 0, _prompt(11))


def test_positions_beyond_max_positions_are_rejected() -> None:
    m = TinyTransformer(ModelConfig(num_layers=1, max_positions=32))
    with pytest.raises(InvalidInput, match="max_positions"):
        m.prefill(_prompt(33))


def test_invalid_configs_say_what_is_wrong() -> None:
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        TinyTransformer(ModelConfig(num_heads=3, num_kv_heads=2))
    with pytest.raises(ConfigError, match="dtype"):
        TinyTransformer(ModelConfig(dtype="float64x"))
