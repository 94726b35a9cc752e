from pyproxy.k8s.informer import Backoff


def test_delays_double_up_to_the_cap_with_jitter_in_the_upper_half() -> None:
    lows = Backoff(initial=0.5, cap=30.0, rng=lambda: 0.0)
    highs = Backoff(initial=0.5, cap=30.0, rng=lambda: 0.999999)
    low = [lows.next() for _ in range(10)]
    high = [highs.next() for _ in range(10)]
    assert low[:4] == [0.25, 0.5, 1.0, 2.0]
    assert all(abs(h - 2 * lo) < 1e-4 for lo, h in zip(low, high, strict=True))
    assert low[-1] == 15.0 and high[-1] <= 30.0  # capped: a restarted API server is retried within 30 s


def test_reset_starts_over() -> None:
    b = Backoff(initial=1.0, cap=8.0, rng=lambda: 0.0)
    for _ in range(5):
        b.next()
    b.reset()
    assert b.next() == 0.5
