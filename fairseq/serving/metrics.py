"""The server's figures in Prometheus' text format (GET /metrics): requests by status, the queue and the running
batch, tokens generated and their rate, time to first token and latency histograms. Written from the HTTP side
and the decode thread, hence the lock."""

import threading
import time
from collections import Counter, deque
from typing import Deque, List, Tuple

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW = 10.0  # seconds of tokens that the tokens-per-second gauge averages


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum, self.count = 0.0, 0

    def observe(self, seconds: float) -> None:
        index = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        self.counts[index] += 1
        self.sum += seconds
        self.count += 1

    def lines(self, name: str) -> List[str]:
        lines, cumulative = [], 0
        for bound, count in zip(BUCKETS + (float("inf"),), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        return lines + [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.queue_length = self.running_rows = 0
        self.tokens_total = 0
        self.recent: Deque[Tuple[float, int]] = deque()  # (time, tokens) over the last RATE_WINDOW seconds
        self.ttft, self.latency = Histogram(), Histogram()

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1
            if endpoint == "/v1/completions" and status == 200:
                self.latency.observe(seconds)

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def tokens(self, count: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.tokens_total += count
            self.recent.append((now, count))
            self._forget(now)

    def batch(self, queue_length: int, running_rows: int) -> None:
        with self.lock:
            self.queue_length, self.running_rows = queue_length, running_rows

    def _forget(self, now: float) -> None:
        while self.recent and self.recent[0][0] < now - RATE_WINDOW:
            self.recent.popleft()

    def text(self) -> str:
        with self.lock:
            self._forget(time.monotonic())
            rate = sum(count for _, count in self.recent) / RATE_WINDOW
            lines = [
                "# HELP fairseq_requests_total Requests answered, by endpoint and HTTP status.",
                "# TYPE fairseq_requests_total counter",
            ]
            lines += [
                f'fairseq_requests_total{{endpoint="{endpoint}",status="{status}"}} {count}'
                for (endpoint, status), count in sorted(self.requests.items())
            ]
            lines += [
                "# HELP fairseq_queue_length Requests waiting for a place in the running batch.",
                "# TYPE fairseq_queue_length gauge",
                f"fairseq_queue_length {self.queue_length}",
                "# HELP fairseq_running_batch_size Rows (completion choices) in the running batch.",
                "# TYPE fairseq_running_batch_size gauge",
                f"fairseq_running_batch_size {self.running_rows}",
                "# HELP fairseq_generated_tokens_total Tokens generated.",
                "# TYPE fairseq_generated_tokens_total counter",
                f"fairseq_generated_tokens_total {self.tokens_total}",
                f"# HELP fairseq_tokens_per_second Tokens generated per second over the last {RATE_WINDOW:g} s.",
                "# TYPE fairseq_tokens_per_second gauge",
                f"fairseq_tokens_per_second {rate:.3f}",
                "# HELP fairseq_time_to_first_token_seconds From a request's arrival to its first token.",
                "# TYPE fairseq_time_to_first_token_seconds histogram",
            ]
            lines += self.ttft.lines("fairseq_time_to_first_token_seconds")
            lines += [
                "# HELP fairseq_request_latency_seconds From a completion request's arrival to its last byte.",
                "# TYPE fairseq_request_latency_seconds histogram",
            ]
            lines += self.latency.lines("fairseq_request_latency_seconds")
            return "\n".join(lines) + "\n"
