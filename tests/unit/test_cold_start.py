import pytest

from actors.cold_start import choose_first_layers, estimate_prefill_layer_seconds, stall_seconds


@pytest.mark.parametrize("num_layers", [1, 2, 12, 22, 32])
@pytest.mark.parametrize("ratio", [0.05, 0.25, 0.5, 0.9, 1.0, 2.0])
def test_chosen_start_never_stalls_and_one_layer_earlier_would(num_layers, ratio):
    load = 0.01
    compute = load * ratio
    n = choose_first_layers(num_layers, load, compute)
    assert 1 <= n <= num_layers
    assert stall_seconds(num_layers, n, load, compute) == pytest.approx(0.0, abs=1e-12)
    if n > 1:
        assert stall_seconds(num_layers, n - 1, load, compute) > 0


def test_compute_slower_than_loading_needs_one_layer():
    assert choose_first_layers(22, load_s_per_layer=0.01, compute_s_per_layer=0.02) == 1


def test_instant_compute_needs_every_layer():
    assert choose_first_layers(16, load_s_per_layer=0.01, compute_s_per_layer=0.0) == 16


def test_longer_prompts_start_earlier():
    per_layer_params = 7_000_000
    counts = [
        choose_first_layers(12, 0.01, estimate_prefill_layer_seconds(per_layer_params, 12, 64, s, 50e9))
        for s in (8, 64, 512)
    ]
    assert counts[0] >= counts[1] >= counts[2]
    assert counts[0] > counts[2]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        choose_first_layers(0, 0.1, 0.1)
    with pytest.raises(ValueError):
        choose_first_layers(4, -1.0, 0.1)
    with pytest.raises(ValueError):
        estimate_prefill_layer_seconds(10, 1, 1, 1, 0.0)
