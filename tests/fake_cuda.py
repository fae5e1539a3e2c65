"""A recording fake of torch.cuda's stream API, for checking on the CPU what a CUDA copy waits for
(tests/test_stream_ordering.py, tests/test_zero_gather.py).

The fake keeps, per stream, the list of work enqueued on it (a position is its length) and, per thread,
the current stream (the default stream unless `torch.cuda.stream(s)` says otherwise), and records every
wait a stream is made to do: on which stream, up to which position. The fixture `cuda` installs it.
"""

import threading

import pytest
import torch


class FakeStream:
    """A stream's queue: kernels, and the waits it was made to do, in the order they were enqueued."""

    def __init__(self, name: str, log: list):
        self.name, self.work, self.log = name, [], log

    def launch(self, what: str) -> int:
        """Enqueues a kernel; returns its position."""
        self.work.append(what)
        return len(self.work)

    def wait_stream(self, other: "FakeStream") -> None:
        self._wait(other, len(other.work))

    def wait_event(self, event: "FakeEvent") -> None:
        self._wait(event.stream, event.position)

    def _wait(self, other: "FakeStream", upto: int) -> None:
        self.work.append(("wait", other, upto))
        self.log.append((self.name, "waits for", other.name, upto))

    def after(self, stream: "FakeStream", upto: int | None = None) -> int:
        """How much of `stream`'s work this stream's first `upto` items are ordered after, through its
        waits and the waits of the streams it waited on."""
        if self is stream:
            return len(self.work) if upto is None else upto
        most = 0
        for item in self.work[:upto]:
            if isinstance(item, tuple):
                _, other, at = item
                most = max(most, other.after(stream, at))
        return most


class FakeEvent:
    def __init__(self, *args, **kwargs):
        self.stream, self.position = None, None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or FakeCuda.current_stream()
        self.position = len(self.stream.work)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeCuda:
    """The parts of torch.cuda that scheduler/streams.py uses."""
    log: list = []
    default: FakeStream
    local = threading.local()

    @classmethod
    def reset(cls) -> None:
        cls.log = []
        cls.default = FakeStream("default", cls.log)
        cls.local = threading.local()

    @classmethod
    def current_stream(cls, device=None) -> FakeStream:
        return getattr(cls.local, "stream", cls.default)

    made = 0

    @classmethod
    def make_stream(cls, device=None) -> FakeStream:
        cls.made += 1
        return FakeStream(f"copy stream {cls.made}", cls.log)

    class stream:  # noqa: N801  (as torch.cuda.stream)
        def __init__(self, s: FakeStream):
            self.s = s

        def __enter__(self):
            self.prev = getattr(FakeCuda.local, "stream", None)
            FakeCuda.local.stream = self.s

        def __exit__(self, *exc):
            FakeCuda.local.stream = self.prev if self.prev is not None else FakeCuda.default


@pytest.fixture
def cuda(monkeypatch):
    FakeCuda.reset()
    monkeypatch.setattr(torch.cuda, "Stream", FakeCuda.make_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeCuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", FakeCuda.stream)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return FakeCuda
