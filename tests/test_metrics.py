"""labs.metrics: the summary's median step time and the words that say which steps it covers agree."""
from labs import metrics


def test_the_timing_names_the_steps_the_median_was_taken_over():
    seconds = [9.0, 5.0, 1.0, 2.0, 3.0, 4.0]
    assert metrics.median_after_warmup(seconds, 2) == 2.5 and metrics.timing(6, 2) == "median of steps 3-6"
    # a run no longer than its warm-up: every step counts, and the words say so (not "steps 3-2")
    assert metrics.median_after_warmup(seconds[:2], 2) == 7.0
    assert metrics.timing(2, 2) == "median of steps 1-2 (none after the 2 warm-up steps)"
