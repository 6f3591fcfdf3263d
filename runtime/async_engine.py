"""AsyncLLMEngine: LLMEngine driven by one background thread, streamed to asyncio consumers.

Steps are CPU-bound (on the CPU backend they *are* the model forward), so they run in a
dedicated thread and the asyncio loop stays free to accept requests and stream tokens.
Every call into the LLMEngine holds one lock, which a step holds for its whole length, so
the event loop never takes it: ``generate`` admits its request (and a cancelled consumer
aborts it) through small helper threads, and awaits them. ``adapters()`` and ``accepting``
take no lock: ``adapters()`` returns a copy of the registered set that register/unregister
replace under the lock. The other calls (``snapshot()``, register/unregister) take the lock:
async callers run them in a worker thread (``asyncio.to_thread``). Outputs are handed to each
request's ``OutputMailbox`` with ``loop.call_soon_threadsafe``; outputs its consumer has not read
yet are merged there, so a stream nobody reads holds a few outputs, not one per step. Cancelling a consumer of
``generate`` aborts its request, which releases its KV blocks and adapter references.
When nothing can run until an adapter is read from disk, the step thread waits for the
load without the lock.
The lock is a ``FairLock`` (``runtime/fair_lock.py``): first come, first served, naming its
holder, and able to be given up on when a holder is stuck at shutdown.

Admission: ``generate`` queues its request and a helper thread takes the lock; whoever holds
the lock next (that helper, another one, or the step thread before its next step) admits
every queued request, so a burst joins the next step together. Requests that must bind to the
same adapter version (one HTTP request's prompts and ``n`` choices) share an
``AdmissionGroup``: their tickets are queued only once all have arrived, as one item that is
admitted in one hold of the lock, so a hot reload (which takes the lock) cannot fall between them.

If a step (or anything else in the step loop) raises, every request in flight is finished
with finish_reason "error" and the message, requests the failed step had already finished
keep their real final output, and the engine refuses new requests (``dead_error`` says why)
rather than hanging its consumers. A consumer whose event loop was closed is dropped.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from runtime.config import EngineConfig
from runtime.daemon_executor import DaemonExecutor
from runtime.engine import CheckedRequest, LLMEngine
from runtime.fair_lock import Acquisition, FairLock
from runtime.file_reader import FileReader
from runtime.lora.registry import AdapterInfo
from runtime.output_mailbox import OutputMailbox
from runtime.request import AdapterRef, ErrorKind, RequestOutput, SamplingParams
from runtime.shutdown_seconds import STEP_GRACE_S, check_shutdown_seconds  # noqa: F401 - STEP_GRACE_S is this module's API too
from runtime.tokenizer import LONG_TEXT_CHARS
from runtime.torch_threads import single_threaded_torch

logger = logging.getLogger(__name__)
SHUTDOWN_POLL_S = 0.05  # shutdown(): how often its wait for the engine lock looks again at its deadline, which a later call may bring forward
STEP_HOLDER = "a step"  # the step thread's name as the engine lock's holder


class EngineDeadError(RuntimeError):
    """The engine's step loop failed or was shut down; no new requests are accepted."""


class GroupRefused(Exception):
    """Not admitted because another request of its admission group was refused (whose own
    error says why)."""


@dataclass
class _Admission:
    """A request waiting to be added to the engine, and the future its ``generate`` awaits."""

    request_id: str
    prompt: Any
    params: Optional[SamplingParams]
    adapter: Optional[str]
    loop: asyncio.AbstractEventLoop
    queue: OutputMailbox
    future: "Future[None]" = field(default_factory=Future)


class AdmissionGroup:
    """Requests to admit together (see the module docstring): pass the same group to the
    ``generate`` call of each of its ``size`` requests. Used from the event loop's thread only."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"AdmissionGroup: size must be an integer >= 1, got {size!r}")
        self.size = size
        self.tickets: list[_Admission] = []
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the loop of its first request; the others must share it
        self.refused: Optional[str] = None  # why, once a request was refused before it joined (``_leave_group``)


def admits_groups(engine: Any) -> bool:
    """Whether ``engine.generate`` takes an admission ``group`` (AsyncLLMEngine does; a Ray
    ingress, or a wrapper that forwards attributes but defines its own ``generate``, may not)."""
    if not hasattr(engine, "admission_group"):
        return False
    parameters = inspect.signature(engine.generate).parameters.values()
    return any(p.name == "group" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class AsyncLLMEngine:
    """See the module docstring. The LLMEngine is built *in* the step thread, so the
    model's torch work (load and steps) runs on one OpenMP thread team. Torch work on the
    caller's other long-lived threads (say the main thread building weights) leaves a second
    team, which slows every step (1.57x on 2 cores): do it through
    ``runtime.torch_threads.in_fresh_thread``."""

    def __init__(self, config: Optional[EngineConfig], backend: Any = None, engine: Optional[LLMEngine] = None) -> None:
        """Build an ``LLMEngine`` from ``config`` (on ``backend``, or the config's device) in the step
        thread; or wrap ``engine``, already built, whose own config and backend then apply: a
        different ``config`` or a ``backend`` beside it is refused, not ignored."""
        import torch

        if engine is not None and (backend is not None or (config is not None and config != engine.config)):
            raise ValueError("AsyncLLMEngine: engine= brings its own config and backend; pass config=None (or the engine's own) and no backend")
        if engine is None and config is None:
            raise ValueError("AsyncLLMEngine: give a config, or a built engine with engine=")

        self._torch_threads = torch.get_num_threads()
        # The creator's current GPU, where it chose one: the step thread starts on GPU 0 whatever the creator set.
        self._creator_cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._files = FileReader("lorafleet-adapter-files", initializer=single_threaded_torch)
        self._built: "Future[LLMEngine]" = Future()
        self._lock = FairLock()
        self._wake = threading.Condition(self._lock)
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, OutputMailbox]] = {}
        self._queues_lock = threading.Lock()  # guards _queues alone, for dict operations only
        # The engine lock can be held for a whole step, so the event loop never takes it:
        # admissions and aborts run in these helper threads (one OpenMP team: see torch_threads).
        # Daemons: one stuck holding the lock (an adapter install on a hung device), which shutdown
        # gives up on, must not hold the process's exit (runtime/daemon_executor.py).
        self._submit = DaemonExecutor(max_workers=4, thread_name_prefix="lorafleet-submit", initializer=single_threaded_torch)
        self._helper_tasks: set["Future[Any]"] = set()  # _submit's tasks not finished yet (shutdown waits for them until its deadline)
        self._helper_tasks_lock = threading.Lock()
        # Requests waiting to be admitted: whoever holds the lock next (a helper or the step thread)
        # admits all of them, so a burst is in the next step, not 4 per step (one per helper).
        self._admissions: deque[tuple[_Admission, ...]] = deque()  # one item per group (a lone request: a group of one)
        # Groups still waiting for members: failed by shutdown() and _die(), so none waits forever.
        self._parked: set[AdmissionGroup] = set()
        self._parked_lock = threading.Lock()
        self._stopping = False
        self._shutdown_once = threading.Lock()  # held by the shutdown() doing the work: a concurrent call waits for it
        self._shut_down = False  # a shutdown() returned: later calls return at once
        self._shutdown_ends: list[tuple[float, float]] = []  # each shutdown() call under way: when its drain ends, when its grace ends
        self._shutdown_ends_lock = threading.Lock()
        self._in_shutdown = threading.local()  # ``.active``: this thread is inside shutdown() (a signal handler's call returns at once)
        self._accepting = True
        self.dead_error: Optional[str] = None
        self._adapter_infos: tuple[AdapterInfo, ...] = ()  # replaced (not mutated) under the lock
        self.engine: LLMEngine  # assigned by the step thread once built
        self._thread = threading.Thread(target=self._run, args=(config, backend, engine), name="lorafleet-engine-step", daemon=True)
        self._thread.start()
        try:
            self._built.result()  # waits for the step thread to build the engine; re-raises its error
        except BaseException:
            self._files.shutdown()
            raise
        with self._lock.held_by("the engine's start"):  # a prebuilt LLMEngine may come with adapters
            self._adapter_infos = tuple(self.engine.adapters())

    # ---- passthroughs -----------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """The step thread starts with the engine; kept for callers that start explicitly."""
        return None

    @property
    def accepting(self) -> bool:
        """False once the engine died or began shutting down: new requests are refused. Lock-free."""
        return self._accepting and self.dead_error is None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def step_abandoned(self) -> bool:
        """True once ``shutdown`` gave up on the engine lock's holder (see there; a step still running
        after the drain, or another call: ``abandoned_holder`` says which): the engine was neither
        drained nor closed, and its lock refuses everyone. Lock-free."""
        return self._lock.abandoned

    @property
    def abandoned_holder(self) -> Optional[str]:
        """What held the engine lock when ``shutdown`` gave up on it ("a step", "a snapshot", ...);
        None unless ``step_abandoned``. Lock-free."""
        return self._lock.abandoned_holder

    def shutdown_in_background(self, timeout: float, step_grace_s: float = STEP_GRACE_S) -> threading.Thread:
        """``shutdown(timeout, step_grace_s)`` in a daemon thread, started; join it to wait (a server's
        drain: its event loop keeps relaying the last outputs and the 503s meanwhile). Lengths that
        ``shutdown`` refuses are refused here, before the thread starts."""
        check_shutdown_seconds(timeout=timeout, step_grace_s=step_grace_s)
        drain = threading.Thread(target=self.shutdown, kwargs={"timeout": timeout, "step_grace_s": step_grace_s}, name="lorafleet-drain", daemon=True)
        drain.start()
        return drain

    def shutdown(self, timeout: float = 30.0, step_grace_s: float = STEP_GRACE_S) -> None:
        """Stop accepting requests, let in-flight ones finish for up to ``timeout`` s, fail the rest.

        The rest are failed under the engine lock, which a step holds: a step still running
        when ``timeout`` is up is waited for ``step_grace_s`` s more. Whatever holds the lock then
        (a step, or another call such as a hung snapshot) is taken to be stuck (a hung device, a
        deadlock), which would otherwise hold the drain (and a server's exit) for ever: an ERROR
        log line says so and names it, every stream in flight ends at once with a "shutdown"
        error, every thread waiting for the engine lock (an admission, an abort, a snapshot for
        /metrics) gets an ``EngineDeadError`` instead, and the engine is not closed (the step
        thread may still use it; that thread is a daemon, so the process can exit).
        ``step_abandoned`` is True then, and ``abandoned_holder`` names what held the lock. Only the
        very hold seen as the wait ended is given up on: one let go of just then is not stuck, and
        the shutdown goes on as usual (a waiter the lock was handed to gets ``SHUTDOWN_POLL_S``
        more, then is given up on the same way). Once the rest are failed, the step thread and the
        helper threads' tasks (admissions, aborts, adapter installs: each only waits for the lock or
        holds it briefly) are waited for until the same deadline; one still going then waits
        behind a holder that took the lock after the requests were failed and did not let go (a
        hung snapshot), which is given up on the same way. Adapter file reads still queued or running
        (``load_adapter_files``, ``register_adapter``) are waited for until the same deadline, as is
        the adapter pool's disk read still running (a request's adapter that had left the host
        tier; those queued behind it are cancelled: their requests have ended); a read cannot be
        interrupted, so one still going then (a stuck network mount) is left to its daemon thread
        (``runtime.file_reader``), which cannot hold the process's exit: a WARNING names what was
        left, its caller and those of the reads queued behind it get an ``EngineDeadError`` at
        once, and the engine is closed without it (``LLMEngine.close``). When the lock is given
        up on, so are the file reads, at once.

        One call does this. A call made while another does it holds that one to its own deadlines
        where they come sooner (the drain ends ``timeout`` s, and the lock is given up on
        ``timeout + step_grace_s`` s, after it was made, at the latest) and returns when that
        one ends; a later call returns at once (after one that raised, the next tries again). A
        call made from the thread already in one (a signal handler that interrupted it) returns at
        once: the interrupted call finishes the work once the handler returns (waiting for it there
        would wait for ever).

        ``timeout`` and ``step_grace_s`` must be numbers of seconds >= 0 (``math.inf``: no end), else
        ValueError and nothing begins (``check_shutdown_seconds``): NaN never passes, so a stuck
        step would be waited for for ever."""
        check_shutdown_seconds(timeout=timeout, step_grace_s=step_grace_s)
        if getattr(self._in_shutdown, "active", False):
            return
        self._in_shutdown.active = True  # before the lock below is taken: a handler run once it is held must see it
        try:
            self._shutdown_call(timeout, step_grace_s)
        finally:
            self._in_shutdown.active = False

    def _shutdown_call(self, timeout: float, step_grace_s: float) -> None:
        """``shutdown``, in a thread not already in it: its deadlines count while it runs or waits."""
        called = time.monotonic()
        ends = (called + timeout, called + timeout + step_grace_s)
        with self._shutdown_ends_lock:
            self._shutdown_ends.append(ends)
        try:
            with self._shutdown_once:
                if self._shut_down:
                    return
                self._shut_down_now(called)
                self._shut_down = True
        finally:
            with self._shutdown_ends_lock:
                self._shutdown_ends.remove(ends)

    def _drain_ends(self) -> float:
        """When the drain ends: the soonest of the shutdown() calls under way."""
        with self._shutdown_ends_lock:
            return min(drain for drain, _ in self._shutdown_ends)

    def _grace_ends(self) -> float:
        """When the lock's holder is given up on: the soonest of the shutdown() calls under way."""
        with self._shutdown_ends_lock:
            return min(grace for _, grace in self._shutdown_ends)

    def _acquire_before(self, ends: Callable[[], float]) -> tuple[bool, Optional[Acquisition]]:
        """Take the engine lock (as shutdown) unless ``ends()`` passes first; ``ends()`` is read
        again every ``SHUTDOWN_POLL_S``, as a later shutdown() call may bring it forward. The wait
        keeps its place in the lock's queue (``FairLock.acquire_or_holder(until=...)``): callers
        that queued after it (admissions, /metrics) do not go first.
        (True, None) once taken, else (False, the acquisition that held it as the wait ended)."""
        return self._lock.acquire_or_holder(timeout=SHUTDOWN_POLL_S, holder="shutdown", until=ends)

    def _shut_down_now(self, started: float) -> None:
        """``shutdown``'s work, done once, by the call made at ``started``."""
        self._accepting = False  # without the lock: refused at once even while a step holds it (admission re-checks under it)
        self._fail_parked("engine is shutting down; no new requests are accepted")
        while self.running and time.monotonic() < self._drain_ends():
            if not self._acquire_before(self._drain_ends)[0]:
                break  # a step outlasted the drain
            try:
                if not self.engine.has_unfinished():
                    break
            finally:
                self._lock.release()
            time.sleep(0.01)
        taken, holding = self._acquire_before(self._grace_ends)
        while not taken:
            self._abandon_holder(started, holding)
            if self.step_abandoned:
                return
            # It let go just as it was given up on: the lock is free, or was handed to a waiter,
            # which gets SHUTDOWN_POLL_S (then is given up on the same way).
            handed_over_ends = time.monotonic() + SHUTDOWN_POLL_S
            taken, holding = self._acquire_before(lambda: handed_over_ends)
        drain_s = self._drain_ends() - started
        try:
            self._stopping = True
            self._dispatch(self.engine.fail_all(f"engine shut down before the request finished (shutdown timeout {drain_s:.3g}s)", "shutdown"))
            adapter_loads = self.engine.stop_adapter_loads()  # the pool's disk reads (a host-tier miss): those queued will not run
            self._wake.notify_all()
        finally:
            self._lock.release()
        with self._helper_tasks_lock:
            self._submit.shutdown(wait=False)  # no new helper tasks: _off_loop runs them in its caller's thread from now on
        if not self._wait_for_lock_users(started):
            return  # what held the engine lock was given up on: the engine is not closed
        self._files.shutdown()
        self._wait_for_file_reads(started, adapter_loads)
        self.engine.close(timeout=max(0.0, self._grace_ends() - time.monotonic()))  # gives up on a pool read still going (a WARNING)
        if self.dead_error is None:
            self.dead_error = "engine was shut down"

    def _lock_users(self) -> list[Any]:
        """The step thread, while it runs, and the helper tasks not finished (``_off_loop``)."""
        with self._helper_tasks_lock:
            users: list[Any] = [task for task in self._helper_tasks if not task.done()]
        if self._thread.is_alive():
            users.append(self._thread)
        return users

    def _wait_for_lock_users(self, started: float) -> bool:
        """After the requests were failed: wait for the step thread to end and the helper tasks
        (admissions, aborts, adapter installs) to finish until the lock's holder would be given up
        on (``_grace_ends``, looked at again every ``SHUTDOWN_POLL_S``). True once they have.

        Each of them only waits for the engine lock or holds it for a moment, so one still going
        then waits behind (or is) a holder that took the lock after the requests were failed and
        did not let go (a hung snapshot): that holder is given up on as in ``shutdown`` (False;
        ``step_abandoned``). A lock shutdown can take within ``SHUTDOWN_POLL_S`` is not stuck:
        everyone queued for it before has had a turn, and the wait goes on."""
        while True:
            users = self._lock_users()
            if not users:
                return True
            left = self._grace_ends() - time.monotonic()
            if left > 0:
                self._wait_for(users, min(left, SHUTDOWN_POLL_S))
                continue
            poll_ends = time.monotonic() + SHUTDOWN_POLL_S
            taken, holding = self._acquire_before(lambda: poll_ends)
            if taken:
                self._lock.release()
                self._wait_for(self._lock_users(), SHUTDOWN_POLL_S)
                continue
            self._abandon_holder(started, holding)
            if self.step_abandoned:
                return False

    def _wait_for(self, users: list[Any], timeout: float) -> None:
        """Wait up to ``timeout`` s for the step thread to end if it is among ``users``, else for
        one of the helper tasks among them to finish."""
        if self._thread in users:
            self._thread.join(timeout)
        elif users:
            wait(users, timeout=timeout, return_when=FIRST_COMPLETED)

    def _wait_for_file_reads(self, started: float, adapter_loads: Sequence["Future[Any]"] = ()) -> None:
        """Wait for the adapter file reads queued or running (``_read_adapter_files``), and for the
        pool's ``adapter_loads`` (``LLMEngine.stop_adapter_loads``), until the lock's holder would be
        given up on (``_grace_ends``: the soonest deadline of the shutdown() calls under way, looked
        at again every ``SHUTDOWN_POLL_S``); then give up on the file reader's rest (the engine's
        ``close`` gives up on the pool's)."""
        while True:
            reads = self._files.pending() + [load for load in adapter_loads if not load.done()]
            if not reads:
                return
            left = self._grace_ends() - time.monotonic()
            if left <= 0:
                break
            wait(reads, timeout=min(left, SHUTDOWN_POLL_S))
        self._give_up_on_file_reads(started)

    def _give_up_on_file_reads(self, started: float) -> None:
        """A read cannot be interrupted: one still going (a stuck network mount) is left to its
        daemon thread, which cannot hold the process's exit; its caller, and the callers of those
        queued behind it (which will not run), get an ``EngineDeadError`` now, and one WARNING
        names what was left."""
        left = self._files.give_up(lambda what: EngineDeadError(f"engine was shut down before the read of {what} ended"))
        if left:
            logger.warning("shutdown: not waiting for %d adapter file read(s) still going %.1f s after shutdown began, which cannot be "
                           "interrupted: %s; their callers get an error now", len(left), time.monotonic() - started, ", ".join(left))

    def _abandon_holder(self, started: float, holding: Optional[Acquisition]) -> None:
        """``shutdown``'s end when ``holding`` (the acquisition that held the lock as the grace
        ended) still holds it (see there). The lock is abandoned only if that same acquisition
        still holds it (``FairLock.abandon(only=...)``, under the lock's mutex); if it let go
        meanwhile nothing changes (``step_abandoned`` stays False) and shutdown goes on as usual."""
        if holding is None:  # not held as the wait ended: nothing to give up on
            return
        holder = holding.holder
        dead = self.dead_error or f"engine was shut down while {holder} was still running"
        self._stopping = True  # the step thread stops, should the step ever return (if the holder let go, the usual shutdown stops it too)
        if not self._lock.abandon(lambda: EngineDeadError(dead), only=holding):
            return
        waited = time.monotonic() - started
        drain_ends = self._drain_ends()
        logger.error("%s still held the engine lock %.1f s after shutdown began (the drain's %.3g s, then %.3g s more for it); not waiting "
                     "for it: the requests in flight end with an error now, and the engine is not closed",
                     holder, waited, drain_ends - started, self._grace_ends() - drain_ends)
        if self.dead_error is None:
            self.dead_error = dead
        self._end_streams(f"engine shut down before the request finished ({holder} was still running {waited:.1f} s after shutdown began)", "shutdown")
        self._refuse_queued(dead)
        self._files.shutdown()
        self._give_up_on_file_reads(started)
        self._submit.shutdown(wait=False)

    # ---- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: Optional[SamplingParams] = None,
        adapter: Optional[str] = None,
        group: Optional[AdmissionGroup] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Validation errors raise before the first output.
        ``group``: admit this request together with the group's other requests."""
        if isinstance(prompt, str) and len(prompt) >= LONG_TEXT_CHARS:
            # Encoded here, in a worker thread that lets go of the GIL, not at admission under the
            # lock: a prompt near the body limit takes about a second, which every stream would wait.
            try:
                prompt = await asyncio.to_thread(self.engine.encode_prompt, prompt)
            except BaseException as err:  # refused or cancelled before it joined its group: the others must not wait for it
                if group is not None:
                    self._leave_group(group, request_id, None if isinstance(err, asyncio.CancelledError) else err)
                raise
        ticket = _Admission(request_id, prompt, params, adapter, asyncio.get_running_loop(), OutputMailbox())
        queue = ticket.queue
        if group is None:
            self._admissions.append((ticket,))
            self._off_loop(self._admit_queued)
        else:
            group.loop = group.loop or ticket.loop
            if group.loop is not ticket.loop:
                raise ValueError("AdmissionGroup: its requests must come from one event loop")
            with self._parked_lock:  # against shutdown() and _die() failing the parked groups
                if not self.accepting:
                    raise EngineDeadError(self.dead_error or "engine is shutting down; no new requests are accepted")
                if group.refused is not None:
                    raise GroupRefused(group.refused)
                if len(group.tickets) >= group.size:
                    raise ValueError(f"AdmissionGroup: more than its {group.size} requests")
                group.tickets.append(ticket)
                full = len(group.tickets) == group.size
                if full:
                    self._parked.discard(group)
                    self._admissions.append(tuple(group.tickets))  # the last one: queue them all as one item
                else:
                    self._parked.add(group)
            if full:
                self._off_loop(self._admit_queued)
        try:
            await asyncio.wrap_future(ticket.future)  # cancelling this cancels the ticket unless its admission began
        except asyncio.CancelledError:  # the request may still be admitted: then take it back out
            ticket.future.add_done_callback(lambda f: not f.cancelled() and f.exception() is None and self._off_loop(self._abort_and_forget, request_id))
            raise
        finished = False
        try:
            while not finished:
                out: RequestOutput = await queue.get()
                finished = out.finished
                yield out
        finally:
            if finished:
                with self._queues_lock:
                    self._queues.pop(request_id, None)
            else:  # the consumer went away: abort, off the event loop. Shielded: a second cancellation
                # (anyio cancel scopes repeat theirs) must not cancel the queued abort and orphan the request.
                await asyncio.shield(asyncio.wrap_future(self._off_loop(self._abort_and_forget, request_id)))

    def _leave_group(self, group: AdmissionGroup, request_id: str, refusal: Optional[BaseException]) -> None:
        """A request of ``group`` that will not join it: its ``generate`` was refused (``refusal``)
        or cancelled before it joined. Refused: the whole group is (its other requests get
        ``GroupRefused``, as at admission). Cancelled: the group waits for one request fewer, and
        is queued if the rest have all arrived (as a consumer that leaves a queued group is skipped)."""
        with self._parked_lock:
            group.size -= 1
            if refusal is not None and group.refused is None:
                group.refused = f"request {request_id!r} of its group was refused: {refusal}"
            waiting = group in self._parked  # its tickets are still ours: not queued, not failed by shutdown
            full = waiting and group.refused is None and len(group.tickets) == group.size
            refused = list(group.tickets) if waiting and group.refused is not None else []
            if full or refused or group.size == 0:
                self._parked.discard(group)
            if full:
                self._admissions.append(tuple(group.tickets))
            if refused:
                group.tickets.clear()
        for ticket in refused:
            if ticket.future.set_running_or_notify_cancel():
                ticket.future.set_exception(GroupRefused(group.refused))
        if full:
            self._off_loop(self._admit_queued)

    @staticmethod
    def admission_group(size: int) -> AdmissionGroup:
        """A group for ``size`` requests to be admitted together (see ``generate``)."""
        return AdmissionGroup(size)

    def _fail_parked(self, message: str) -> None:
        """Fail the requests of groups still waiting for members (no request is accepted any more)."""
        with self._parked_lock:
            tickets = [t for group in self._parked for t in group.tickets]
            self._parked.clear()
        for ticket in tickets:
            if ticket.future.set_running_or_notify_cancel():
                ticket.future.set_exception(EngineDeadError(message))

    def _admit_queued(self) -> None:
        """Helper thread: take the lock and admit every queued request (nothing to do if another
        holder of the lock already did)."""
        if not self._admissions:
            return
        try:
            self._lock.acquire(holder="an admission")
        except EngineDeadError as err:  # shutdown gave up on a stuck step: nobody admits any more
            self._refuse_queued(str(err))
            return
        try:
            self._drain_admissions()
        finally:
            self._lock.release()

    def _refuse_queued(self, message: str) -> None:
        """Fail every queued admission with ``EngineDeadError(message)`` (the lock was abandoned)."""
        while self._admissions:
            try:
                group = self._admissions.popleft()
            except IndexError:  # another thread took the last one
                return
            for ticket in group:
                if ticket.future.set_running_or_notify_cancel():
                    ticket.future.set_exception(EngineDeadError(message))

    def _drain_admissions(self) -> None:
        """Admit every queued request; the lock is held. Each ticket's future gets the outcome.
        A group is checked whole first: if one of its requests is refused, none is admitted
        (the others get ``GroupRefused``), so none runs or shows in the metrics."""
        admitted = False
        while self._admissions:
            group = [t for t in self._admissions.popleft() if t.future.set_running_or_notify_cancel()]  # skip consumers that left
            checked, refused, ids = [], None, set()
            for ticket in group:
                try:
                    if ticket.request_id in ids:
                        raise ValueError(f"request_id: {ticket.request_id!r} appears twice in one admission group")
                    ids.add(ticket.request_id)
                    checked.append(self._check(ticket))
                except BaseException as err:  # noqa: BLE001 - handed to the awaiting generate()
                    refused = (ticket, err)
                    break
            if refused is not None:
                bad, err = refused
                for ticket in group:
                    ticket.future.set_exception(err if ticket is bad else GroupRefused(f"request {bad.request_id!r} of its group was refused: {err}"))
                continue
            for ticket, request in zip(group, checked):
                try:
                    self.engine.add_checked(request)
                except BaseException as err:  # noqa: BLE001 - handed to the awaiting generate()
                    ticket.future.set_exception(err)
                    continue
                with self._queues_lock:
                    self._queues[ticket.request_id] = (ticket.loop, ticket.queue)
                ticket.future.set_result(None)
                admitted = True
        if admitted:
            self._wake.notify_all()

    def _check(self, ticket: _Admission) -> CheckedRequest:
        if self.dead_error is not None or not self._accepting:
            raise EngineDeadError(self.dead_error or "engine is shutting down; no new requests are accepted")
        with self._queues_lock:
            if ticket.request_id in self._queues:
                raise ValueError(f"request_id: {ticket.request_id!r} is already in flight")
        return self.engine.check_request(ticket.request_id, ticket.prompt, ticket.params, ticket.adapter)

    def _off_loop(self, fn: Any, *args: Any) -> "Future[Any]":
        """Run ``fn`` in a submit thread; inline once the engine is shut down (no step holds the lock then)."""
        try:
            with self._helper_tasks_lock:  # against shutdown's _submit.shutdown: a task it lets in is one it waits for
                task = self._submit.submit(fn, *args)
                self._helper_tasks.add(task)
        except RuntimeError:  # the executor is shut down
            done: "Future[Any]" = Future()
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting caller
                done.set_exception(err)
            return done
        task.add_done_callback(self._helper_task_done)  # at once if it is done already
        return task

    def _helper_task_done(self, task: "Future[Any]") -> None:
        with self._helper_tasks_lock:
            self._helper_tasks.discard(task)

    def _abort_and_forget(self, request_id: str) -> None:
        """Abort for a consumer that has gone, and drop its pending outputs (left waiting, they
        would reach a new request that reuses the id)."""
        try:
            self._lock.acquire(holder="an abort")
        except EngineDeadError:  # shutdown gave up on a stuck step and ended every stream: nothing to abort
            with self._queues_lock:
                self._queues.pop(request_id, None)
            return
        try:
            self.engine.abort(request_id)
            self.engine.drop_pending([request_id])
            with self._queues_lock:
                self._queues.pop(request_id, None)
            self._wake.notify_all()
        finally:
            self._lock.release()

    def abort(self, request_id: str) -> bool:
        with self._lock.held_by("an abort"):
            found = self.engine.abort(request_id)
            self._wake.notify_all()
            return found

    def register_adapter(self, name: str, path: str, *, within: Optional[Sequence[str | Path]] = None) -> AdapterRef:
        # Reading and validating the files happens outside the lock (steps keep running), in a
        # single-threaded helper (see runtime/torch_threads.py).
        return self.install_adapter(self.load_adapter_files(name, path, within=within), path)

    def load_adapter_files(self, name: str, path: str, *, within: Optional[Sequence[str | Path]] = None) -> Any:
        """Read and validate an adapter folder without the lock (``LLMEngine.load_adapter_files``,
        ``within`` as there)."""
        return self._read_adapter_files(name, path, within=within).result()

    def _read_adapter_files(self, name: str, path: str, *, within: Optional[Sequence[str | Path]] = None) -> "Future[Any]":
        """``LLMEngine.load_adapter_files`` queued in the engine's file reader thread; shutdown
        waits for it until its deadline (``_wait_for_file_reads``)."""
        try:
            return self._files.submit(f"adapter {name!r} from {path}", self.engine.load_adapter_files, name, path, within=within)
        except RuntimeError as err:  # the file reader is shut down with the engine
            raise EngineDeadError(self.dead_error or "engine was shut down") from err

    def install_adapter(self, adapter: Any, path: str) -> AdapterRef:
        """Make an adapter already read and checked current (``LLMEngine.install_adapter``), under the lock."""
        with self._lock.held_by("an adapter load"):
            self._check_not_shut_down()
            ref = self.engine.install_adapter(adapter, str(path))
            self._adapter_infos = tuple(self.engine.adapters())
            return ref

    async def register_adapter_async(self, name: str, path: str, *, within: Optional[Sequence[str | Path]] = None) -> AdapterRef:
        """``register_adapter`` for asyncio callers, on the engine's own threads, not the event
        loop's default executor (where a slow read would hold a thread that other work, e.g. a
        server's /metrics, waits for): the files are read in the file reader thread, and the
        install waits for the lock in an admission helper thread. The result is the same, ``within``
        as there."""
        adapter = await asyncio.wrap_future(self._read_adapter_files(name, path, within=within))
        return await asyncio.wrap_future(self._off_loop(self.install_adapter, adapter, path))

    def unregister_adapter(self, name: str) -> None:
        with self._lock.held_by("an adapter unload"):
            self._check_not_shut_down()
            self.engine.unregister_adapter(name)
            self._adapter_infos = tuple(self.engine.adapters())

    def _check_not_shut_down(self) -> None:
        """Adapter changes need a live engine (during a drain they still apply); after ``shutdown``,
        or once a step failed (``dead_error``), they are an EngineDeadError, as requests are, and
        change nothing. (After a failed step a load used to be installed into the dead engine: a
        200 on the admin route for an adapter no request could use.)"""
        if self._stopping or self.dead_error is not None:
            raise EngineDeadError(self.dead_error or "engine was shut down")

    def adapters(self) -> list[AdapterInfo]:
        """The registered adapters, without the lock (the event loop calls this for every request):
        the copy the last register/unregister made, so it never waits for a step."""
        return list(self._adapter_infos)

    def snapshot(self) -> dict[str, Any]:
        with self._lock.held_by("a snapshot"):
            return self.engine.snapshot()

    def fold_adapter_counters(self, names: Any) -> None:
        """``LLMEngine.fold_adapter_counters``; takes the lock only if some name is not registered."""
        registered = {info.name for info in self._adapter_infos}
        unregistered = [name for name in names if name not in registered]
        if unregistered:
            with self._lock.held_by("a fold of adapter counters"):
                self.engine.fold_adapter_counters(unregistered)

    def add_observer(self, callback: Any) -> None:
        """``callback(RequestMetrics)`` runs on the step thread; keep it short and thread-safe."""
        with self._lock.held_by("an observer registration"):
            self.engine.add_observer(callback)

    # ---- the step thread ----------------------------------------------------------------------
    def _run(self, config: EngineConfig, backend: Any, engine: Optional[LLMEngine]) -> None:
        import torch

        torch.set_num_threads(self._torch_threads)  # the creator's count, whatever helpers set
        try:
            on_gpu = _engine_gpu(engine, backend)
            if on_gpu is not None or self._creator_cuda_device is not None:
                # Each thread has its own current GPU, and Triton launches on it, not on the tensors' GPU.
                torch.cuda.set_device(on_gpu if on_gpu is not None else self._creator_cuda_device)
            built = engine if engine is not None else LLMEngine(config, backend)
        except BaseException as err:  # handed to the constructor, which re-raises it
            self._built.set_exception(err)
            return
        self.engine = built  # set before anyone waits on _built, so the loop below can use it
        self._built.set_result(built)
        try:
            while self._one_iteration():
                pass
        except BaseException as err:  # noqa: BLE001 - reported to every consumer, then the loop stops
            if self.step_abandoned:  # shutdown gave up on this step and ended the streams; the lock is abandoned
                if isinstance(err, EngineDeadError):  # this thread waited for the lock, which another thread held: no step ran
                    return
                logger.error("engine step abandoned at shutdown ended with %s: %s", type(err).__name__, err)
                return
            self._die(err)

    def _one_iteration(self) -> bool:
        """Wait for work, run one step and hand its outputs out; False once stopping."""
        if self._stopping:  # also after shutdown abandoned a stuck step, whose lock then refuses everyone
            return False
        self._lock.acquire(holder=STEP_HOLDER)
        try:
            self._drain_admissions()
            while not self._stopping and not self.engine.has_unfinished():
                self._wake.wait()  # keeps the holder's name (FairLock._release_save)
                self._drain_admissions()
            if self._stopping:
                return False
            ran_before = self.engine.steps
            self._dispatch(self.engine.step(wait_for_loads=False))
            stalled = self.engine.stalled_load_futures()
            idle = self.engine.steps == ran_before and self.engine.has_unfinished() and not stalled
        finally:
            self._lock.release()
        # Nothing can run until an adapter load finishes: wait for it without the lock, so
        # requests, aborts and snapshots go through meanwhile; in short slices, so runnable work
        # admitted meanwhile (e.g. a base-model request) waits at most ~5 ms.
        if stalled:
            wait(stalled, timeout=0.005, return_when=FIRST_COMPLETED)
        elif idle:
            time.sleep(0.002)
        return True

    def _die(self, err: BaseException) -> None:
        """The step loop failed: refuse new requests and end every stream with the error. Outputs
        the failed step had already made (requests it finished) are handed out first."""
        logger.error("engine step failed: %s: %s", type(err).__name__, err, exc_info=err)
        with self._lock.held_by("the failed step's clean-up"):
            self.dead_error = f"engine step failed: {type(err).__name__}: {err}"
            self._accepting = False
            try:
                self._dispatch(self.engine.fail_all(self.dead_error))
            except BaseException as again:  # noqa: BLE001 - the streams must still end
                logger.error("failing the requests in flight failed too: %s: %s", type(again).__name__, again, exc_info=again)
                self._end_streams(self.dead_error)
            self._drain_admissions()  # queued requests get EngineDeadError now
        self._fail_parked(self.dead_error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._queues_lock:
            targets = [self._queues.get(out.request_id) for out in outputs]
        for out, target in zip(outputs, targets):
            if target is not None:
                self._deliver(out.request_id, target, out)

    def _deliver(self, request_id: str, target: tuple[asyncio.AbstractEventLoop, OutputMailbox], out: RequestOutput) -> None:
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put, out)
        except RuntimeError:  # its event loop was closed (checking first would race with the close): nobody to tell
            with self._queues_lock:
                self._queues.pop(request_id, None)

    def _end_streams(self, message: str, error_kind: ErrorKind = "engine") -> None:
        """End every stream with an error output, without the lock or the engine: the last resort
        when fail_all itself failed, or when shutdown gave up on a stuck step."""
        with self._queues_lock:
            targets = dict(self._queues)
        for request_id, target in targets.items():
            self._deliver(request_id, target, RequestOutput(request_id, None, (), "", (), "", True, "error", message, (), error_kind=error_kind))


def _engine_gpu(engine: Optional[LLMEngine], backend: Any) -> Optional[Any]:
    """The GPU (a cuda ``torch.device`` with an index) the given engine or backend runs on, else None."""
    device = engine.backend.device if engine is not None else getattr(backend, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda" and device.index is not None:
        return device
    return None
