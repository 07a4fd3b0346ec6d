import pytest
import torch

from actors.sampling import SamplingError, SamplingParams, make_generator, sample
from actors.stop_sequences import StopSequenceFilter


def _logits(v: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    assert make_generator(params, "cpu") is None
    assert sample(logits, params, None).item() == logits.argmax().item()


def test_same_seed_same_draws_and_other_seed_differs():
    logits = _logits()
    p = SamplingParams(max_tokens=1, temperature=1.0, seed=1234)

    def draws(params):
        g = make_generator(params, "cpu")
        return [sample(logits, params, g).item() for _ in range(64)]

    assert draws(p) == draws(p)
    assert draws(p) != draws(SamplingParams(max_tokens=1, temperature=1.0, seed=4321))


def test_top_k_restricts_support():
    logits = _logits(seed=3)
    p = SamplingParams(max_tokens=1, top_k=3, seed=0)
    g = make_generator(p, "cpu")
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    seen = {sample(logits, p, g).item() for _ in range(500)}
    assert seen <= top3 and len(seen) > 1
    k1 = SamplingParams(max_tokens=1, top_k=1, seed=0)
    assert sample(logits, k1, make_generator(k1, "cpu")).item() == logits.argmax().item()


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_same_nucleus_as_transformers(top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    from actors.sampling import top_p_filter

    logits = _logits(v=200, seed=7)
    ours = torch.isinf(top_p_filter(logits.clone(), top_p))
    theirs = torch.isinf(TopPLogitsWarper(top_p)(None, logits.clone()))
    assert torch.equal(ours, theirs)


def test_sampling_follows_the_distribution():
    # Two tokens with probabilities 0.8 / 0.2: the exponential race must reproduce them.
    logits = torch.log(torch.tensor([[0.8, 0.2]]))
    p = SamplingParams(max_tokens=1, seed=5)
    g = make_generator(p, "cpu")
    ones = sum(sample(logits, p, g).item() for _ in range(4000))
    assert 0.17 < ones / 4000 < 0.23


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": 1, "temperature": -0.1},
        {"max_tokens": 1, "temperature": 2.5},  # beyond OpenAI's 2, the widest API range
        {"max_tokens": 1, "top_k": 0},
        {"max_tokens": 1, "top_p": 0.0},
        {"max_tokens": 1, "top_p": 1.2},
        {"max_tokens": 1, "stop_sequences": ("",)},
        {"max_tokens": 1, "stop_sequences": tuple(str(i) for i in range(17))},
        {"max_tokens": 4, "min_tokens": 5},
        {"max_tokens": 4, "min_tokens": -1},
    ],
)
def test_out_of_range_params_are_refused(kwargs):
    with pytest.raises(SamplingError):
        SamplingParams(**kwargs)


def test_stop_filter_cuts_exactly_across_chunks():
    f = StopSequenceFilter(("END", "\n\n"))
    out = []
    for chunk in ["hello E", "N", "D there"]:
        text, matched = f.push(chunk)
        out.append(text)
        if matched:
            break
    assert "".join(out) == "hello " and matched == "END"


def test_stop_filter_releases_a_prefix_that_did_not_complete():
    f = StopSequenceFilter(("STOP",))
    assert f.push("abc ST") == ("abc ", None)
    assert f.push("x") == ("STx", None)
    assert f.flush() == ""


def test_stop_filter_picks_the_earliest_match():
    f = StopSequenceFilter(("bb", "a"))
    assert f.push("xbba") == ("x", "bb")


def test_stop_filter_without_stops_passes_through():
    f = StopSequenceFilter(())
    assert f.push("abc") == ("abc", None)
