"""The matmul peak (MFU's denominator): measured per size, merged over a run's two measurements."""

from bench import matmul


def test_the_two_measurements_merge_by_size_keeping_the_higher_figure_even_where_a_size_was_left_out():
    first = {"threads": 2, "fp32": {"by_size": {"512": 4.0, "1024": 6.0}},
             "bf16": {"by_size": {"512": 2.0, "1024": 1.0}}}
    second = {"threads": 2, "fp32": {"by_size": {"512": 5.0, "1024": 5.5}},
              "bf16": {"by_size": {"512": 3.0}}}  # its 1024 was skipped: slower than 512 there
    merged = matmul.best_of(first, second)
    assert merged["fp32"] == {"peak_flops": 6.0, "by_size": {"512": 5.0, "1024": 6.0}}
    assert merged["bf16"] == {"peak_flops": 3.0, "by_size": {"512": 3.0, "1024": 1.0}}


def test_a_peak_is_measured_for_each_dtype_and_size_within_its_time():
    peaks = matmul.measure_peaks("cpu", (16, 32), seconds=0.01)
    for name in matmul.DTYPES:
        assert set(peaks[name]["by_size"]) <= {"16", "32"} and "16" in peaks[name]["by_size"]
        assert peaks[name]["peak_flops"] == max(peaks[name]["by_size"].values()) > 0
