"""engine.save_checkpoint(..., background=True): the checkpoint of a step boundary written while training goes
on; its handle's wait() returns the path, done() says whether it is published ([Note: background saves]).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time

from offload.checkpoint import format as fmt
from offload.checkpoint import saving
from offload.checkpoint.format import CheckpointError
from offload.plan.chunks import chunk_key
from offload.state.tiers import ChunkPool
from offload.swap.backends import IOPRIO_IDLE

# [Note: background saves]
# What the checkpoint must hold is the state at the step boundary where it was asked; what changes after it
# is each unit's optimizer states (and the weights written from them), when the next step updates that unit.
# States on nvme are held at the swap ([Note: held entries] in offload/swap/store.py): the step's writes of
# them go to other extents while the saver reads the boundary's, so the step never waits for the saver, which
# may take more than one step. That costs the swap file up to the held bytes (kept for later saves), so it is
# done only where the nvme budget and the free disk beside the checkpoint take them; otherwise, and for states
# in hbm or dram, the step's update of a unit waits until the saver has written it (Runtime.before_update):
# the saver writes the units the last first (backward's order, in which the next step updates them).
# Everything else is taken at the request, in the caller's thread: the counters, the RNG states, the model's
# buffers. The saver reads the states through a one-chunk pool of its own (three for a split master), so
# that a step holding the runtime's pool never waits for it; its reads of held states are idle blocks ([Note:
# idle blocks] in swap/backends.py) and its writes go WRITE_BYTES at a time ([Note: direct checkpoint writes]
# in offload/checkpoint/datafile.py), so the step's own I/O passes them and the saver takes the gaps. It
# writes the same files as a blocking save, published the same way: `latest` moves only once the whole
# checkpoint is written and verified. Over ranks each rank writes its part; the manifest is merged and
# published at a later step boundary once every rank's part is written (an agreement at each step()), or by
# wait() (every rank calls it). A failure in the saver is raised at the next step(), save_checkpoint(),
# close() or wait(); the previous checkpoint and `latest` stay as they were.


class BackgroundSaveError(CheckpointError):
    """A background checkpoint that failed; `path` is the checkpoint it would have been."""

    def __init__(self, path: str, cause: str):
        super().__init__(f"the background checkpoint {path} failed ({cause}); nothing was published: the previous "
                         "checkpoint and `latest` are as they were, and training is unaffected")
        self.path, self.cause = path, cause


class BackgroundSave:
    """A checkpoint being written in the background ([Note: background saves]): wait() -> its path (raises
    BackgroundSaveError if it failed), done() -> whether it is published; seconds, exposed_s: how long it
    took and how long training waited for it."""

    def __init__(self, engine, directory: str, name: str | None, keep: int | None, extra: dict | None):
        name, self.manifest, accumulator = saving.prepare(engine, name, keep, extra)
        if accumulator:
            raise ValueError("save_checkpoint(background=True): at this boundary the gradient accumulator must be "
                             "saved (inside an accumulation window, or delayed_update's pending update), and the next "
                             "backward changes it; save blocking (background=False) here")
        t0 = time.perf_counter()
        self.engine, self.rt, self.directory, self.name, self.keep = engine, engine.rt, directory, name, keep
        held = saving.snapshot(engine)
        self.final, self.tmp = (saving.begin_ranks(engine, directory, name) if self.rt.world > 1
                                else fmt.begin(directory, name))
        self._written = {u.index: threading.Event() for u in engine.units}
        self._hold, self._held_keys, self._gated = None, {}, set(self._written)
        self._part = None           # this rank's part once written, or its error as a string
        self.saver_cpu_s = 0.0      # the CPU time of the saver thread (user and system)
        self._finished = threading.Event()  # the part written (and in one process, published or failed)
        self._path: str | None = None
        self._error: str | None = None
        self._closed = False
        try:
            split = self.rt.settings.optimizer.master == "split"  # a window's record, its weights, the master
            self._staging = ChunkPool(self.rt.tiers, self.rt.staging.chunk_bytes, 3 if split else 1)
            self._hold_states(engine)
        except BaseException:
            if self._hold is not None:
                self._hold.close()
            fmt.abort(self.tmp)
            raise
        self.seconds: float | None = None
        self.exposed_s = time.perf_counter() - t0
        self._t0 = t0
        self.rt.before_update = self._before_update
        # not a daemon: a process whose script ends with a save in flight finishes it before it exits
        self._thread = threading.Thread(target=self._run, args=(held,), name="offload-checkpoint", daemon=False)
        self._thread.start()

    def _hold_states(self, engine) -> None:
        """Holds the nvme states at the swap where room allows ([Note: background saves]): each unit whose
        states (and a split master's weights) are all on nvme is then not gated."""
        store, keys = self.rt.store, {}
        if store is None or not HOLD_AT_SWAP or not (self.rt.rank == 0 or self.rt.sharded):
            return  # stage 0: rank 0 alone writes states
        for unit in engine.units:
            st, w = engine.states[unit.index], engine.weights[unit.index]
            if st is not None and st.home == "nvme" and (not st.split or w.home == "nvme"):
                keys[unit.index] = [st.key(kind, i) for kind in st.state_kinds for i in st.mine]
                keys[unit.index] += [chunk_key(w.key, i) for i in st.mine] if st.split else []
        hold = store.hold(k for ks in keys.values() for k in ks)
        try:
            beside = os.stat(store.run_dir).st_dev == os.stat(self.tmp).st_dev  # the checkpoint takes as much
            room = (store.disk_bytes + hold.growth <= self.rt.tiers.acct["nvme"].budget_bytes
                    and shutil.disk_usage(store.run_dir).free >= hold.growth + hold.nbytes * beside)
        except BaseException:
            hold.close()
            raise
        if not room or not keys:
            hold.close()
            return
        self._hold, self._held_keys = hold, keys
        self._gated -= set(keys)

    def _before_update(self, index: int) -> None:
        """The step is about to update unit `index`: returns once the saver has written it (at once where
        its states are held at the swap)."""
        event = self._written.get(index) if index in self._gated else None
        if event is not None and not event.is_set():
            t = time.perf_counter()
            event.wait()
            self.exposed_s += time.perf_counter() - t

    def _run(self, held: dict) -> None:
        _lower_priority()
        cpu = time.thread_time()
        try:
            self._part = saving.save_part(self.engine, self.tmp, False, held, staging=self._staging,
                                          saved=self._saved, hold={u: self._hold for u in self._held_keys})
        except BaseException as e:  # noqa: BLE001  (raised to the caller at its next step or wait)
            self._part = f"rank {self.rt.rank}: {e}" if self.rt.world > 1 else str(e)
        finally:
            for event in self._written.values():  # a failed save never holds the step
                event.set()
            if self._hold is not None:
                self._hold.close()
            self._staging.close()
            self.saver_cpu_s = time.thread_time() - cpu
        if self.rt.world == 1:
            self._publish_alone()
        self._finished.set()

    def _saved(self, index: int) -> None:
        self._written[index].set()
        if self._hold is not None:
            self._hold.release(self._held_keys.get(index, ()))

    def _publish_alone(self) -> None:
        if isinstance(self._part, str):
            fmt.abort(self.tmp)
            self._error = self._part
            return
        try:
            fmt.write_manifest(self.tmp, {**self.manifest, **saving.merge([self._part])})
            fmt.commit(self.tmp, self.final)
            self._path = saving.published(self.directory, self.name, self.keep, self.manifest["run_id"])
        except BaseException as e:  # noqa: BLE001
            fmt.abort(self.tmp)
            self._error = str(e)

    def done(self) -> bool:
        return self._path is not None or self._error is not None

    def poll(self) -> bool:
        """At a step boundary, on every rank: over ranks, publishes once every rank's part is written (a
        collective each call). True once finished; raises BackgroundSaveError if it failed."""
        if self.rt.world > 1 and not self.done():
            written = self.rt.ranks.agree([float(self._finished.is_set())], "min", "the background checkpoint")[0]
            if written:
                self._publish_ranks()
        return self._settled() if self.done() else False

    def wait(self) -> str:
        """Waits for the checkpoint (over ranks a collective: every rank calls it) and returns its path."""
        t = time.perf_counter()
        self._thread.join()
        self.exposed_s += time.perf_counter() - t
        if self.rt.world > 1 and not self.done():
            self._publish_ranks()
        self._settled()
        return self._path

    def _publish_ranks(self) -> None:
        try:
            self._path = saving.finish_ranks(self.engine, self.directory, self.name, self.keep, self.manifest,
                                             self.final, self.tmp, self._part)
        except CheckpointError as e:
            self._error = str(e)

    def _settled(self) -> bool:
        if not self._closed:
            self._closed = True
            self.seconds = time.perf_counter() - self._t0
            if self.rt.before_update == self._before_update:
                self.rt.before_update = None
        if self._error is not None:
            raise BackgroundSaveError(self.final, self._error)
        return True

    def stats(self) -> dict:
        """{"seconds": from the request to the checkpoint published (None until then), "exposed_s": how long
        training waited for it: the request itself, units not yet written when the step reached them, wait();
        "held_bytes": the nvme states held at the swap, "gated_units": units whose update waits for the saver,
        "saver_cpu_s": the saver thread's CPU time, what it took from the cores beside the step}."""
        return {"seconds": self.seconds, "exposed_s": self.exposed_s, "saver_cpu_s": self.saver_cpu_s,
                "held_bytes": self._hold.nbytes if self._hold is not None else 0,
                "gated_units": sum(1 for u in self._gated if self.engine.states[u] is not None)}


HOLD_AT_SWAP = True  # False: every unit gated, as where the swap has no room (bench/checkpoint.py's gated rows)
SAVER_NICE = 10  # the saver yields the cores to the step's threads (Linux: per thread)


def _lower_priority() -> None:
    """The calling thread's scheduling priority lowered by SAVER_NICE, and its I/O put in the idle class (the
    drive serves it when the step's I/O leaves it idle), where the OS sets them per thread (Linux); elsewhere,
    or when refused, left as they are."""
    try:
        nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + SAVER_NICE)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass
    _set_io_idle(threading.get_native_id())


IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set syscall's number


def _set_io_idle(tid: int) -> bool:
    """Thread `tid`'s I/O in the idle class (Linux's ioprio_set, who = IOPRIO_WHO_PROCESS, per thread): the
    block layer's schedulers that take priorities (mq-deadline, bfq) serve it after other I/O. False where
    the OS has no such call or refuses it."""
    import ctypes
    import platform

    number = IOPRIO_SET.get(platform.machine()) if sys.platform == "linux" else None
    if number is None:
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(number, 1, tid, IOPRIO_IDLE) == 0
    except (OSError, AttributeError):
        return False
