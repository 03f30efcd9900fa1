"""Batched sampler (runtime/engine/sampler.py): masks and penalties against hand-computed values, seeded
reproducibility whatever the batch, logprobs, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.runtime.engine.sampler import (
    SamplingParams,
    SamplingState,
    final_probs,
    process_logits,
    sample_batch,
)

LOGITS = [1.0, 3.0, 2.0, 0.5]  # softmax ≈ [.0854, .6308, .2320, .0518]


def softmax_on(logits, keep, temperature=1.0):
    """Hand reference: softmax of logits/temperature over the ids in `keep`, zero elsewhere."""
    e = [math.exp(x / temperature) if i in keep else 0.0 for i, x in enumerate(logits)]
    return [v / sum(e) for v in e]


def probs_of(logits, **kw):
    params = SamplingParams(**{"top_p": 1.0, "temperature": 1.0, **kw})
    return final_probs(torch.tensor([logits]), [SamplingState(params)])[0]


def check(got, want):
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float32), atol=1e-6, rtol=0), (got, want)
    assert set(got.nonzero().flatten().tolist()) == {i for i, w in enumerate(want) if w > 0}


@pytest.mark.parametrize("kw, keep, temperature", [
    (dict(), {0, 1, 2, 3}, 1.0),
    (dict(top_k=2), {1, 2}, 1.0),
    (dict(top_k=1), {1}, 1.0),
    (dict(top_k=9), {0, 1, 2, 3}, 1.0),  # k past the vocabulary: off
    (dict(top_p=0.6), {1}, 1.0),  # .6308 alone reaches .6
    (dict(top_p=0.7), {1, 2}, 1.0),  # .6308 < .7 ≤ .8628: the crossing token is kept
    (dict(top_p=0.9), {0, 1, 2}, 1.0),  # .8628 < .9 ≤ .9482
    (dict(top_p=0.95), {0, 1, 2, 3}, 1.0),  # the mass before token 3 is .9482 < .95
    (dict(top_p=0.6, temperature=2.0), {1, 2}, 2.0),  # top-p sees the tempered [.163,.442,.268,.127]
    (dict(min_p=0.1), {0, 1, 2}, 1.0),  # floor .0631: drops .0518
    (dict(min_p=0.2), {1, 2}, 1.0),  # floor .1262
    (dict(min_p=0.3, temperature=2.0), {0, 1, 2}, 2.0),  # tempered floor .1327 keeps .1627
    (dict(top_k=3, top_p=0.7), {1, 2}, 1.0),  # top-p over the renormalized top-3
    (dict(top_k=3, min_p=0.1), {0, 1, 2}, 1.0),
])
def test_truncation_masks_are_exact(kw, keep, temperature):
    check(probs_of(LOGITS, **kw), softmax_on(LOGITS, keep, temperature))


def test_top_k_keeps_ties_at_the_kth_value_and_greedy_is_one_hot():
    check(probs_of([2.0, 2.0, 1.0, 0.0], top_k=1), softmax_on([2.0, 2.0, 1.0, 0.0], {0, 1}))
    check(probs_of(LOGITS, temperature=0), [0.0, 1.0, 0.0, 0.0])


def test_rows_of_one_batch_keep_their_own_masks():
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=2.0, top_p=1.0, min_p=0.3), SamplingParams(temperature=0)]
    got = final_probs(torch.tensor([LOGITS] * 4), [SamplingState(p) for p in params])
    check(got[0], softmax_on(LOGITS, {1, 2}))
    check(got[1], softmax_on(LOGITS, {0, 1, 2}))
    check(got[2], softmax_on(LOGITS, {0, 1, 2}, 2.0))
    check(got[3], [0.0, 1.0, 0.0, 0.0])


def test_draws_follow_the_final_distribution_and_never_pick_masked_tokens():
    for kw in (dict(), dict(top_k=2)):
        state = SamplingState(SamplingParams(temperature=1.0, top_p=1.0, seed=5, **kw))
        want = final_probs(torch.tensor([LOGITS]), [state])[0]
        n = 4000
        counts = torch.zeros(4)
        for _ in range(n):
            counts[sample_batch(torch.tensor([LOGITS]), [state])[0].token] += 1
        assert (counts[want == 0] == 0).all()
        assert torch.allclose(counts / n, want, atol=0.025), (counts / n, want)


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(0))
    states = [SamplingState(SamplingParams(temperature=0, top_k=5, top_p=0.5)) for _ in range(8)]
    assert [r.token for r in sample_batch(logits, states)] == logits.argmax(-1).tolist()
    assert sample_batch(torch.tensor([[1.0, 5.0, 5.0, 2.0]]), [SamplingState(SamplingParams(temperature=0))])[0].token == 1


def processed(logits, prompt=(), output=(), **kw):
    state = SamplingState(SamplingParams(**kw), list(prompt), list(output))
    return process_logits(torch.tensor([logits]), [state])[0].tolist()


PEN = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # seen = prompt {0, 1} + output {1, 3}; token 5 (logit 0) and unseen tokens are untouched
    assert processed(PEN, [0, 1], [1, 3, 3], repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, -2.0, 0.0]
    assert processed(PEN, [5], [], repetition_penalty=0.5) == PEN  # 0 stays 0 either way


def test_presence_and_frequency_penalties_count_output_tokens_only():
    # output counts {1: 1, 3: 2}; the prompt's token 0 is not penalized
    got = processed(PEN, [0], [1, 3, 3], presence_penalty=0.5, frequency_penalty=0.25)
    assert got == [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 0.5 - 0.5, -2.0, 0.0]
    assert processed(PEN, [0], [1, 3, 3], presence_penalty=-1.0) == [2.0, 0.0, 0.5, 4.0, -2.0, 0.0]


def test_penalties_then_logit_bias_clipped_to_100():
    got = processed(PEN, [0, 1], [1, 3, 3], repetition_penalty=2.0, presence_penalty=0.5,
                    frequency_penalty=0.25, logit_bias={2: 5.0, 5: -300.0, 4: 1e9})
    assert got == [1.0, -2.75, 5.5, 0.5, 98.0, -100.0]


def test_logit_bias_is_validated_copied_and_checked_against_the_vocab():
    bias = {1: 500, 2: -math.inf}
    p = SamplingParams(logit_bias=bias)
    bias[3] = 1.0  # the caller's dict changing later does not change the request
    assert dict(p.logit_bias) == {1: 100.0, 2: -100.0}
    with pytest.raises(ValueError, match="logit_bias.*vocabulary"):
        sample_batch(torch.zeros(1, 4), [SamplingState(SamplingParams(logit_bias={4: 1.0}))])
    # a ban holds: the greedy choice moves off the banned argmax
    banned = SamplingState(SamplingParams(temperature=0, logit_bias={1: -100}))
    assert sample_batch(torch.tensor([LOGITS]), [banned])[0].token == 2


def steps(n_steps, V, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(V, generator=g) * 3 for _ in range(n_steps)]


def test_seeded_output_is_the_same_alone_or_anywhere_in_any_batch():
    V, n = 300, 40
    ours = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, presence_penalty=0.3, seed=1234)
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=7, logprobs=3),
              SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=1.3), SamplingParams(temperature=1.0, min_p=0.1)]
    ours_logits = steps(n, V, 0)

    def generate(params, position):
        """Run `ours` for n steps at `position` among the other requests; → its tokens."""
        plist = others[:position] + [params] + others[position:]
        states = [SamplingState(p, prompt_ids=[1, 2, 3]) for p in plist]
        noise = [steps(n, V, 100 + j) for j in range(len(plist))]
        for t in range(n):
            rows = [ours_logits[t] if j == position else noise[j][t] for j in range(len(plist))]
            for s, r in zip(states, sample_batch(torch.stack(rows), states)):
                s.output_ids.append(r.token)
        return states[position].output_ids

    alone = [SamplingState(ours, prompt_ids=[1, 2, 3])]
    for t in range(n):
        alone[0].output_ids.append(sample_batch(ours_logits[t][None], alone)[0].token)
    expected = alone[0].output_ids
    assert len(set(expected)) > 10  # a real sample, not a near-greedy walk
    assert generate(ours, 0) == expected
    assert generate(ours, 3) == expected  # a batch of 5, fourth row
    assert generate(SamplingParams(**{**ours.__dict__, "seed": 1235}), 3) != expected


def test_logprobs_are_the_processed_distribution_before_temperature():
    V = 20
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0, logprobs=20), SamplingParams(temperature=1.5, seed=1, logprobs=20),
              SamplingParams(temperature=0.3, seed=1, logprobs=5, top_k=3), SamplingParams(logprobs=0, seed=2)]
    states = [SamplingState(p) for p in params]
    res = sample_batch(logits, states)
    full = torch.log_softmax(logits, -1)
    for i, r in enumerate(res):
        assert math.isclose(r.logprob, full[i, r.token].item(), abs_tol=1e-6)
        alts = r.top_logprobs
        assert len(alts) == params[i].logprobs
        assert [lp for _, lp in alts] == sorted((lp for _, lp in alts), reverse=True)
        assert all(math.isclose(lp, full[i, t].item(), abs_tol=1e-6) for t, lp in alts)
        if params[i].logprobs == V:  # every token listed: the probabilities sum to 1
            assert math.isclose(sum(math.exp(lp) for _, lp in alts), 1.0, abs_tol=1e-5)
        if alts:
            assert dict(alts).get(r.token, r.logprob) == pytest.approx(r.logprob)
    assert res[0].top_logprobs[0] == (res[0].token, pytest.approx(res[0].logprob))  # greedy: the top one
    assert res[3].top_logprobs == []
    # logprobs follow the penalties and bias (they are part of the processed logits)
    biased = sample_batch(logits[:1], [SamplingState(SamplingParams(temperature=0, logprobs=1, logit_bias={0: 100}))])[0]
    assert biased.token == 0 and biased.top_logprobs[0][0] == 0 and biased.logprob > -1e-3
    plain = sample_batch(logits[:1], [SamplingState(SamplingParams(seed=1))])[0]
    assert plain.logprob is None and plain.top_logprobs is None


def test_a_state_s_output_drives_its_penalties():
    state = SamplingState(SamplingParams(temperature=0, presence_penalty=2.0))
    logits = torch.tensor([[1.0, 0.5, 0.0]])
    picks = []
    for _ in range(3):
        picks.append(sample_batch(logits, [state])[0].token)
        state.output_ids.append(picks[-1])
    assert picks == [0, 1, 2]  # each pick is pushed down by 2 afterwards


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan),
    ("top_k", -1), ("top_k", 1.5), ("min_p", -0.1), ("min_p", 1.0),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5), ("presence_penalty", math.nan), ("frequency_penalty", -3),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {1: math.nan}), ("logit_bias", {"a": 1.0}), ("logit_bias", [1, 2]),
    ("seed", 1.5), ("seed", 2**64), ("max_tokens", 0), ("max_tokens", True),
    ("stop", ("",)), ("stop", (1,)), ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
    ("ignore_eos", "yes"), ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5),
])
def test_bad_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_normalize_and_shape_mismatch():
    p = SamplingParams(stop="###", stop_token_ids=[2, 3])
    assert p.stop == ("###",) and p.stop_token_ids == (2, 3)
    assert SamplingParams(seed=-1).seed == -1 and sample_batch(torch.zeros(0, 5), []) == []
    with pytest.raises(ValueError, match="rows"):
        sample_batch(torch.zeros(2, 5), [SamplingState(SamplingParams())])


@pytest.mark.gpu
def test_cuda_logits_give_the_cpu_tokens():
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0)) * 4
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, min_p=m, seed=s, logprobs=2, presence_penalty=0.5)
              for t, tp, k, m, s in [(0, 1, 0, 0, 0), (1.0, 0.9, 0, 0, 1), (0.7, 1, 40, 0, 2), (1.2, 0.95, 0, 0.05, 3),
                                     (1.0, 1.0, 0, 0, 4), (0.8, 0.8, 100, 0.01, 5)]]
    cpu = sample_batch(logits, [SamplingState(p, [1, 2], [3]) for p in params])
    gpu = sample_batch(logits.cuda(), [SamplingState(p, [1, 2], [3]) for p in params])
    assert [r.token for r in gpu] == [r.token for r in cpu]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(cpu, gpu))


def test_callers_logits_are_not_modified():
    logits = torch.tensor([LOGITS])
    sample_batch(logits, [SamplingState(SamplingParams(logit_bias={0: 5.0}, seed=0))])
    assert logits.tolist() == [LOGITS]


@pytest.mark.parametrize("scale, top_p", [(0.05, 0.9), (0.5, 0.5), (4.0, 0.95), (8.0, 0.3)])
def test_nucleus_matches_a_full_sort_whatever_candidate_size_settles_it(scale, top_p):
    # flat rows (scale 0.05 over 6000 tokens) need the full vocabulary, peaked ones the top 256
    logits = torch.randn(3, 6000, generator=torch.Generator().manual_seed(1)) * scale
    got = final_probs(logits, [SamplingState(SamplingParams(temperature=1.0, top_p=top_p))] * 3)
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(-1, descending=True)
    n_keep = ((sorted_p.cumsum(-1) - sorted_p) < top_p).sum(-1)
    for i in range(3):
        keep = set(order[i, :n_keep[i]].tolist())
        assert set(got[i].nonzero().flatten().tolist()) == keep
        assert torch.allclose(got[i], probs[i] * (got[i] > 0) / probs[i, list(keep)].sum(), atol=1e-7)
