"""A swap I/O backend that fails the blocks a test chooses (tests/test_swap_failures.py, tests/test_io_faults.py)."""

import threading


class FaultyBackend:
    """Wraps a real backend; `fail(block)` returns None (do the I/O) or the result to report instead."""

    name = "faulty"

    def __init__(self, inner, fail):
        self.inner, self.fail = inner, fail

    def submit(self, blocks):
        real = []
        for b in blocks:
            result = self.fail(b)
            if result is None:
                real.append(b)
            else:  # complete from another thread, as a real backend would
                threading.Thread(target=b.done, args=(b, result)).start()
        self.inner.submit(real)

    def close(self):
        self.inner.close()
