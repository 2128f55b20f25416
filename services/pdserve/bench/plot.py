"""`--plot PATH.png`: latency distributions and throughput over time, one figure.

matplotlib is the `bench` extra, not a dependency of the server: `check_plotting` tells a
missing one before the run, in one line, rather than a traceback after it."""
from pdserve.bench.metrics import RequestRecord, token_events
from pdserve.common.errors import ConfigError

NUM_HISTOGRAM_BINS = 30
NUM_TIME_BUCKETS = 40


def check_plotting(plot_path: str) -> None:
    """Raise ConfigError naming `--plot` when matplotlib cannot be imported here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--plot", plot_path, f"needs matplotlib ({exc}); install it with "
                          "pip install 'pdserve[bench]'") from None


def throughput_series(
    records: list[RequestRecord], duration_s: float
) -> tuple[list[float], list[float], list[float]]:
    """(NUM_TIME_BUCKETS + 1 bucket edges, output tokens/s, completed requests/s per bucket).

    The run is cut into NUM_TIME_BUCKETS equal buckets; rates are per second of bucket.
    """
    num_buckets = NUM_TIME_BUCKETS
    width = max(duration_s, 1e-9) / num_buckets
    tokens = [0.0] * num_buckets
    requests = [0.0] * num_buckets
    for when, count in token_events(records):
        tokens[min(int(when // width), num_buckets - 1)] += count / width
    for record in records:
        if record.is_success:
            bucket = min(int((record.start_time + record.finish_time) // width), num_buckets - 1)
            requests[bucket] += 1 / width
    return [i * width for i in range(num_buckets + 1)], tokens, requests


def write_plot(records: list[RequestRecord], duration_s: float, path: str, title: str) -> None:
    """Histograms of TTFT, TPOT, ITL and E2EL (ms, successful requests) and two
    throughput-over-time panels, saved as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    succeeded = [r for r in records if r.is_success]
    samples = {
        "TTFT (ms)": [r.ttft * 1000 for r in succeeded],
        "TPOT (ms)": [r.tpot * 1000 for r in succeeded if r.tpot is not None],
        "ITL (ms)": [gap * 1000 for r in succeeded for gap in r.itls],
        "E2E latency (ms)": [r.latency * 1000 for r in succeeded],
    }
    figure, axes = plt.subplots(2, 3, figsize=(15, 8))
    for axis, (label, values) in zip(axes.flat, samples.items()):
        axis.hist(values, bins=NUM_HISTOGRAM_BINS)
        axis.set_xlabel(label)
        axis.set_ylabel("count")
    edges, tokens, requests = throughput_series(records, duration_s)
    for axis, series, label in ((axes.flat[4], tokens, "output tok/s"), (axes.flat[5], requests, "completed req/s")):
        axis.stairs(series, edges)
        axis.set_xlabel("time since start (s)")
        axis.set_ylabel(label)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
