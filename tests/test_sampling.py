"""Sampling: the draw for position p is a function of (seed, p) alone (contract C3), and the
filters (temperature, top-k, top-p, min-p, repetition penalty, OpenAI's presence and frequency
penalties) do what their names say."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import KvstoreError
import kvstore
from kvstore.engine.sampling import (SamplerSettings, apply_logit_bias, apply_repetition_penalty, apply_reply_penalties,
                                     draw, min_p_mask, probabilities, sample, top_k_mask, top_p_mask, uniform)

WARM = SamplerSettings(temperature=1.0)


def logits_of(probs):
    return torch.tensor([math.log(p) if p > 0 else float("-inf") for p in probs], dtype=torch.float32)


def random_logits(seed, n=1000):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


# -- randomness as a function of (seed, position) ----------------------------------------------------
def test_the_same_seed_and_position_give_the_same_draw():
    assert uniform(7, 123) == uniform(7, 123)
    logits = random_logits(0)
    assert sample(logits, WARM, seed=7, position=123) == sample(logits.clone(), WARM, seed=7, position=123)


def test_draws_do_not_depend_on_what_was_drawn_before():
    logits = random_logits(1)
    forward = [sample(logits, WARM, seed=5, position=p) for p in range(50)]
    backward = [sample(logits, WARM, seed=5, position=p) for p in reversed(range(50))]
    assert forward == backward[::-1]


def test_different_seeds_or_positions_give_different_draws():
    assert len({uniform(s, 10) for s in range(100)}) == 100
    assert len({uniform(3, p) for p in range(100)}) == 100
    logits = torch.zeros(1000)  # uniform over 1000 tokens
    a = [sample(logits, WARM, seed=1, position=p) for p in range(40)]
    b = [sample(logits, WARM, seed=2, position=p) for p in range(40)]
    assert a != b
    assert len(set(a)) > 30


def test_uniform_draws_lie_in_the_unit_interval_and_look_uniform():
    draws = [uniform(11, p) for p in range(4000)]
    assert all(0 <= u < 1 for u in draws)
    counts = torch.histc(torch.tensor(draws), bins=10, min=0, max=1)
    assert counts.min() > 330 and counts.max() < 470  # 400 expected per bin


def test_sampled_frequencies_follow_the_probabilities():
    probs = [0.6, 0.3, 0.1]
    picks = [sample(logits_of(probs), WARM, seed=9, position=p) for p in range(3000)]
    for token, p in enumerate(probs):
        assert abs(picks.count(token) / 3000 - p) < 0.03


def test_sampling_runs_in_float32_on_the_cpu_whatever_the_input():
    logits = random_logits(2, 100)
    as_bf16 = logits.to(torch.bfloat16)
    assert sample(as_bf16, WARM, seed=1, position=4) == sample(as_bf16.float(), WARM, seed=1, position=4)


# -- greedy and temperature --------------------------------------------------------------------------
def test_temperature_zero_is_argmax_whatever_the_seed():
    logits = random_logits(3)
    greedy = SamplerSettings(temperature=0.0, top_k=5, top_p=0.5)
    assert {sample(logits, greedy, seed=s, position=s) for s in range(20)} == {int(logits.argmax())}


def test_greedy_picks_what_torch_argmax_picks_among_ties_infinities_and_nans():
    """The first of equal maxima, +inf over any number, a NaN over everything (torch.argmax's choices,
    which sessions made before decoded with)."""
    greedy = SamplerSettings(temperature=0.0)
    g = torch.Generator().manual_seed(0)
    for i in range(300):
        logits = torch.randint(-3, 3, (500,), generator=g).float()  # many ties
        if i % 3 == 0:
            logits[torch.randint(0, 500, (2,), generator=g)] = float("nan")
        if i % 5 == 0:
            logits[torch.randint(0, 500, (2,), generator=g)] = float("inf")
        if i % 7 == 0:
            logits[:] = float("-inf")
        assert sample(logits, greedy, seed=0, position=i) == int(torch.argmax(logits)), i


def test_low_temperature_concentrates_on_the_best_token():
    logits = torch.tensor([1.0, 2.0, 1.5])
    cold = SamplerSettings(temperature=0.05)
    assert {sample(logits, cold, seed=1, position=p) for p in range(200)} == {1}


def test_temperature_scales_logits_before_the_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0])
    probs = probabilities(logits, SamplerSettings(temperature=2.0))
    torch.testing.assert_close(probs, torch.softmax(logits / 2, -1))


# -- masks on hand-made logits ---------------------------------------------------------------------------
def test_top_k_keeps_the_k_highest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    assert top_k_mask(logits, 2).tolist() == [False, True, False, True, False]
    assert top_k_mask(logits, 1).tolist() == [False, True, False, False, False]


def test_top_k_keeps_every_tie_at_the_kth_value():
    assert top_k_mask(torch.tensor([5.0, 4.0, 4.0, 1.0]), 2).tolist() == [True, True, True, False]


def test_top_k_zero_or_at_least_vocab_keeps_everything():
    logits = torch.tensor([1.0, 2.0, 3.0])
    assert top_k_mask(logits, 0).all() and top_k_mask(logits, 3).all() and top_k_mask(logits, 10).all()


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    # ids out of probability order, to prove the mask maps back to ids
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    assert top_p_mask(logits, 0.7).tolist() == [False, True, False, True]
    assert top_p_mask(logits, 0.81).tolist() == [True, True, False, True]
    assert top_p_mask(logits, 0.5).tolist() == [False, True, False, False]
    assert top_p_mask(logits, 0.01).tolist() == [False, True, False, False]  # the best always stays
    assert top_p_mask(logits, 1.0).all()


def test_min_p_keeps_tokens_at_least_min_p_times_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert min_p_mask(probs, 0.2).tolist() == [True, True, True, False]
    assert min_p_mask(probs, 0.5).tolist() == [True, True, False, False]


def test_filters_combine_and_renormalise():
    logits = logits_of([0.4, 0.3, 0.2, 0.1])
    probs = probabilities(logits, SamplerSettings(temperature=1.0, top_k=3, min_p=0.6))
    torch.testing.assert_close(probs, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_masked_tokens_are_never_sampled():
    logits = logits_of([0.3, 0.3, 0.2, 0.2])
    s = SamplerSettings(temperature=1.0, top_k=2)
    assert {sample(logits, s, seed=4, position=p) for p in range(300)} == {0, 1}


def test_draw_is_an_inverse_cdf_in_token_order():
    probs = torch.tensor([0.25, 0.0, 0.75])
    assert draw(probs, 0.0) == 0
    assert draw(probs, 0.2) == 0
    assert draw(probs, 0.25) == 2  # never the zero-probability token at the boundary
    assert draw(probs, 0.999999) == 2


@settings(max_examples=60, deadline=None, database=None)
@given(seed=st.integers(0, 2**32), position=st.integers(0, 10**6), top_k=st.integers(0, 20),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.9), temperature=st.floats(0.1, 3.0))
def test_a_sampled_token_always_survives_every_filter(seed, position, top_k, top_p, min_p, temperature):
    logits = random_logits(seed % 1000, 64)
    s = SamplerSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    token = sample(logits, s, seed=seed, position=position)
    assert top_k_mask(logits, top_k)[token]
    assert top_p_mask(logits / temperature, top_p)[token]
    assert probabilities(logits, s)[token] > 0


# -- repetition penalty -----------------------------------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]
    assert logits.tolist() == [2.0, -1.0, 3.0, 0.5]  # the input is left alone


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([2.0, 1.9, 0.0])
    plain = SamplerSettings()
    penalised = SamplerSettings(repetition_penalty=1.2)
    assert sample(logits, plain, seed=0, position=5, history=[0]) == 0
    assert sample(logits, penalised, seed=0, position=5, history=[0]) == 1


def test_repetition_penalty_looks_only_at_the_recent_window():
    logits = torch.tensor([2.0, 1.9, 0.0])
    s = SamplerSettings(repetition_penalty=1.2, repetition_window=2)
    assert sample(logits, s, seed=0, position=9, history=[0, 2, 2]) == 0  # token 0 is 3 back
    assert sample(logits, s, seed=0, position=9, history=[2, 0, 2]) == 1


# -- presence and frequency penalties (OpenAI's) -------------------------------------------------------------
def test_reply_penalties_subtract_presence_and_frequency_times_the_count():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = apply_reply_penalties(logits, [2, 0, 2, 2], presence=0.5, frequency=0.25)
    assert out.tolist() == [1.0 - 0.75, 1.0, 1.0 - 1.25, 1.0]
    assert logits.tolist() == [1.0] * 4  # the input is left alone
    assert apply_reply_penalties(logits, [1], presence=-1.0, frequency=0.0).tolist() == [1.0, 2.0, 1.0, 1.0]


def test_reply_penalties_count_only_the_reply_and_change_the_greedy_choice():
    logits = torch.tensor([2.0, 1.9, 0.0])
    s = SamplerSettings(presence_penalty=0.2)
    assert sample(logits, s, seed=0, position=5, history=[1, 0, 2], reply_start=2) == 0  # the reply: [2]
    assert sample(logits, s, seed=0, position=5, history=[1, 0, 2], reply_start=1) == 1  # [0, 2]: 1.8 < 1.9
    assert sample(logits, s, seed=0, position=5, history=[1, 0, 2], reply_start=0) == 0  # both: 1.8 > 1.7
    assert sample(logits, s, seed=0, position=5, history=[1, 0, 2]) == 0  # no reply named: no penalty
    f = SamplerSettings(frequency_penalty=0.15)
    assert sample(logits, f, seed=0, position=5, history=[0, 1], reply_start=0) == 0  # 2.0-0.15 > 1.9-0.15
    assert sample(logits, f, seed=0, position=5, history=[0, 0, 1], reply_start=0) == 1  # 2.0-0.3 < 1.9-0.15


def test_a_reply_with_penalties_resumed_after_an_interruption_is_the_uninterrupted_one(tmp_path, model):
    """The penalties count the reply's tokens from where it began, not from where the resumed
    generation took over, so the resumed reply draws what the uninterrupted one drew."""
    store = kvstore.open_store(tmp_path / "home")
    whole, first = whole_and_cut(store, model, dict(temperature=0.9, presence_penalty=1.5, frequency_penalty=0.7))
    with store.open("cut", model) as s:
        rest = resumed_ids(s)
    with store.new("plain", model, seed=3, temperature=0.9) as s:
        s.append_text("once upon a time")
        plain = list(s.generate(24, stop_at_eos=False))
    store.close()
    assert first + rest == whole
    assert plain != whole  # the penalties did something


def test_logit_bias_adds_to_the_named_logits_after_the_penalties():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])
    assert torch.equal(apply_logit_bias(logits, ((1, 0.25), (3, -5.0))), logits + torch.tensor([0, 0.25, 0, -5.0]))
    assert torch.equal(logits, torch.tensor([2.0, 1.9, 0.0, -1.0]))  # the input is left alone
    assert sample(logits, SamplerSettings(logit_bias={1: 0.25}), seed=0, position=3) == 1  # greedy: 2.15 > 2.0
    ban = SamplerSettings(temperature=1.0, logit_bias={0: -100, 1: -100, 3: -100})
    assert {sample(logits, ban, seed=0, position=p) for p in range(50)} == {2}
    # after the penalties: the penalised token 0 (2.0 - 0.5) loses to 1 only with the bias on 1 (1.9 + 0.1)
    pen = dict(presence_penalty=0.5)
    assert sample(logits, SamplerSettings(**pen), seed=0, position=3, history=[0], reply_start=0) == 1
    assert sample(logits, SamplerSettings(**pen, logit_bias={0: 0.5}), seed=0, position=3, history=[0],
                  reply_start=0) == 0


def test_a_session_with_logit_bias_keeps_it_checkpointed_and_resumes_exactly(tmp_path, model):
    """The bias is a setting of the session (C2): recorded at its checkpoints, in force after a
    reopen, so a generation cut short and resumed draws what an uninterrupted one drew; a call's
    bias replaces the session's ({} clears it); ids outside the vocabulary (and any bad setting of
    a call) are refused before the call adds its turn or records anything."""
    store = kvstore.open_store(tmp_path / "home")
    whole, first = whole_and_cut(store, model, dict(temperature=0.9, logit_bias={"5": 3.0, 9: -100}))
    with store.open("cut", model) as s:
        assert s.settings.logit_bias == ((5, 3.0), (9, -100.0))
        rest = resumed_ids(s)
        assert first + rest == whole
        assert 9 not in whole  # banned
        assert list(s.generate(4, stop_at_eos=False, logit_bias={5: 100})) == [5] * 4  # all but forced
        vocab = model.config.vocab_size
        with pytest.raises(KvstoreError, match=f"logit_bias names token id {vocab}; this model's token ids are"):
            list(s.generate(2, logit_bias={vocab: 1.0}))
        assert s.settings.logit_bias == ((5, 100.0),)  # left as it was
        tokens, messages = list(s.tokens), [dict(m) for m in s.messages]
        for bad in (dict(logit_bias={vocab: 1.0}), dict(temperature=-1.0), dict(max_new_tokens=-1)):
            with pytest.raises(KvstoreError):  # refused before the turn is added
                "".join(s.chat("and then?", **{"max_new_tokens": 2, **bad}))
            assert s.tokens == tokens and [dict(m) for m in s.messages] == messages, bad
        list(s.generate(2, logit_bias={}))
        assert s.settings.logit_bias == ()
    with pytest.raises(KvstoreError, match="logit_bias names token id"):
        store.new("too-far", model, logit_bias={10**6: 1.0})
    assert "too-far" not in store.names()
    store.close()


def whole_and_cut(store, model, settings: dict) -> tuple[list[int], list[int]]:
    """24 tokens generated after "once upon a time" by session "whole" (seed 3, `settings`), and the
    first 9 of session "cut", made alike and interrupted there (its call left open, checkpointed)."""
    with store.new("whole", model, seed=3, **settings) as s:
        s.append_text("once upon a time")
        whole = list(s.generate(24, stop_at_eos=False))
    with store.new("cut", model, seed=3, **settings) as s:
        s.append_text("once upon a time")
        cut = s.generate(24, stop_at_eos=False)
        first = [next(cut) for _ in range(9)]
        cut.close()
    return whole, first


def resumed_ids(session) -> list[int]:
    """The ids a resumed generation adds (Session.resume yields text; the tokens are the session's)."""
    before = len(session.tokens)
    "".join(session.resume())
    return session.tokens[before:]


# -- settings -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(min_p=1.0), dict(min_p=-0.1), dict(repetition_penalty=0.0),
                                 dict(repetition_window=-1), dict(top_k=2.5), dict(repetition_window=8.0),
                                 dict(presence_penalty=2.5), dict(frequency_penalty=-2.1),
                                 dict(logit_bias={1: 100.5}), dict(logit_bias={-1: 1.0}), dict(logit_bias={"x": 1.0}),
                                 dict(logit_bias={1.5: 1.0}), dict(logit_bias={1: float("nan")}),
                                 dict(logit_bias={1: True}), dict(logit_bias=[(1, 2, 3)]), dict(logit_bias=5),
                                 dict(logit_bias={i: 1.0 for i in range(1025)})])
def test_invalid_settings_are_refused_with_the_setting_named(bad):
    (name,) = bad
    with pytest.raises(KvstoreError, match=name):
        SamplerSettings(**bad)


def test_settings_round_trip_through_a_dict_and_refuse_unknown_keys():
    s = SamplerSettings(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    assert SamplerSettings.from_dict(s.to_dict()) == s
    with pytest.raises(KvstoreError, match="temprature"):
        SamplerSettings.from_dict({"temprature": 0.7})


def test_penalties_are_written_only_where_they_are_on():
    """Rows and archives of sessions without them read in versions that predate them."""
    assert "presence_penalty" not in SamplerSettings(temperature=0.7).to_dict()
    s = SamplerSettings(frequency_penalty=0.5)
    assert s.to_dict()["frequency_penalty"] == 0.5 and "presence_penalty" not in s.to_dict()
    assert SamplerSettings.from_dict(s.to_dict()) == s


def test_logit_bias_is_written_only_where_it_is_given_and_reads_back_from_json():
    assert "logit_bias" not in SamplerSettings(temperature=0.7).to_dict()
    s = SamplerSettings(logit_bias={"7": -1, 2: 0.5})
    assert s.logit_bias == ((2, 0.5), (7, -1.0))
    written = json.loads(json.dumps(s.to_dict()))  # as a session's row and an archive's manifest hold it
    assert written["logit_bias"] == [[2, 0.5], [7, -1.0]]
    assert SamplerSettings.from_dict(written) == s


def test_default_settings_are_greedy():
    assert SamplerSettings().greedy and not WARM.greedy
