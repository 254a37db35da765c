"""Continuous batching: the model calls of every running job meet in one forward per engine step.

Each job runs in a greenlet of its own. Its session calls the model as the library always does
(`feed` a prompt chunk or the last sampled token, then `head`); through `BatchedModel` such a call
hands the request to the engine loop's greenlet and waits. Once every job of the round has either
finished its step or asked the model, the loop answers the requests together: one `Model.feed_rows`
over all the decode tokens and the prompt rows the step has room for (the rest wait for the next
step, in order of arrival), then one `Model.head` over every final state that asked for logits.

How many prompt rows go beside decode tokens (`Pace`): as many as keep the step within
`max_slowdown` times a step of the decode tokens alone, from the seconds the steps took so far, so a
long document read by one client slows the others' tokens by that factor at most, and is read all
the same (at least `Pace.LEAST` rows a step). A step with no decode token reads whole chunks while
`step_tokens` holds. Where the model computes every row alone (`Model.row_invariant`) a chunk is cut
to fit: its rows compute alike in a piece of any size. Elsewhere a chunk is never cut (its bounds
are the session's own, absolute multiples of its chunk size, so a prompt read in company is read in
exactly the library's kernel calls) and the oldest waiting chunk goes into every step whole.

The bits (contract C9): `feed_rows` gives every item what `feed` gives it alone, and the head's
rows are computed alone too, so a session's tokens and logits are the library's whatever runs
beside it. A call made outside the loop's greenlets (warm-up, tests) goes straight to the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from greenlet import GreenletExit, getcurrent, greenlet


@dataclass
class Request:
    kind: str  # "feed" or "head"
    args: tuple
    arrived: int  # the round it was made in: prompt chunks are served first come, first served

    @property
    def rows(self) -> int:
        return len(self.args[0]) if self.kind == "feed" else 1


STEPPED = ("feed", "alone")  # the kinds answered by a step's feed (`Batcher._answer_feeds`); "alone": a
# call computed by itself (args: the function), one a step


class BatchedModel:
    """A model whose `feed` and `head`, called from a job's greenlet, wait for the loop's next batch;
    everything else is the model's own."""

    def __init__(self, model, batcher: "Batcher", new_cache: Callable[[], Any] | None = None):
        self._model, self._batcher, self._new_cache = model, batcher, new_cache

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def new_cache(self, capacity: int = 0):
        """A cache in the engine's paged KV memory (blocks taken as positions are written), when it has one."""
        return self._model.new_cache(capacity) if self._new_cache is None else self._new_cache()

    def feed(self, ids, pos, cache):
        return self._batcher.call("feed", (list(ids), pos, cache), lambda: self._model.feed(ids, pos, cache))

    def head(self, hidden):
        if hidden.dim() == 2:  # a scored prompt chunk's rows (`feed_all`'s): see there
            return self._alone(lambda: self._model.head(hidden))
        return self._batcher.call("head", (hidden,), lambda: self._model.head(hidden))

    def feed_all(self, ids, pos, cache):
        """A prompt chunk scored row by row (`Session.append_scored`: the completions API's echo with
        logprobs), and then the head over its rows, are each computed by themselves in a step of their
        own, beside the step's decode tokens (`Batcher`: one such call a step): the other sessions
        go on between them, as beside a chunk that cannot be cut."""
        return self._alone(lambda: self._model.feed_all(ids, pos, cache))

    def _alone(self, fn: Callable[[], Any]):
        return self._batcher.call("alone", (fn,), fn)


@dataclass
class Step:
    """What one engine step's forward fed (the metrics'): sessions, decode tokens, prompt tokens, and
    the seconds its model calls took (the forward and the output head)."""
    sessions: int = 0
    decode_rows: int = 0
    prefill_rows: int = 0
    model_s: float = 0.0


class Pace:
    """The prompt rows a step may read beside `decode` decode tokens, learnt from the steps' seconds:
    (max_slowdown - 1) x a decode-only step's seconds / a prompt row's seconds, within
    [LEAST, step_tokens - decode]. Until both are measured: LEAST (the first mixed steps measure them)."""

    # prompt rows a step reads at least, beside any number of decode tokens: few, since a row deep in a
    # long prompt costs about what a decode step of a few sessions does (its attention reads the whole
    # prefix); at 8, 4 sessions decoding beside a 7,800-token read slowed 2.5-3x, past max_slowdown
    LEAST = 2
    WEIGHT = 0.2  # of each new measurement in the running averages

    def __init__(self, step_tokens: int, max_slowdown: float):
        self.step_tokens, self.max_slowdown = step_tokens, max_slowdown
        self.decode_s: float | None = None  # a step of decode tokens alone
        self.row_s: float | None = None  # one prompt row, beyond the decode tokens beside it

    def observe(self, decode: int, prompt: int, seconds: float) -> None:
        if prompt == 0:
            if decode:
                self.decode_s = self._mean(self.decode_s, seconds)
        elif decode == 0:
            self.row_s = self._mean(self.row_s, seconds / prompt)
        elif self.decode_s is not None:
            self.row_s = self._mean(self.row_s, max(seconds - self.decode_s, 0.0) / prompt)

    def rows(self, decode: int) -> int:
        room = max(self.LEAST, self.step_tokens - decode)
        if self.decode_s is None or not self.row_s:
            return min(self.LEAST, room)
        allowed = int((self.max_slowdown - 1) * self.decode_s / self.row_s)
        return max(self.LEAST, min(room, allowed))

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.WEIGHT * (new - old)


class Batcher:
    def __init__(self, model, step_tokens: int, max_slowdown: float = 2.0):
        self.model, self.step_tokens = model, step_tokens
        self.pace = Pace(step_tokens, max_slowdown)
        self.cut = bool(getattr(model, "row_invariant", False))  # a prompt chunk may be read in pieces
        self.hub: greenlet | None = None  # the loop's greenlet while it runs jobs
        self.round = 0
        self.waiting: dict[str, tuple[greenlet, Request]] = {}  # jobs asking the model, their greenlets

    def abandon(self, job: str) -> None:
        """A job cancelled while it waits for the model: its call raises GreenletExit, so its session
        closes its generator as on any interruption (a checkpoint)."""
        entry = self.waiting.pop(job, None)
        if entry is not None:
            self.hub, hub = getcurrent(), self.hub
            try:
                entry[0].throw(GreenletExit)
            finally:
                self.hub = hub

    def call(self, kind: str, args: tuple, direct: Callable[[], Any]):
        me = getcurrent()
        if self.hub is None or me.parent is not self.hub:
            return direct()
        answer = self.hub.switch(Request(kind, args, self.round))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def run(self, steps: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], Step]:
        """Advance each job by one step (`steps[id]()` returns its next event) with their model calls
        batched; returns each finished job's event (or the exception it raised) and what ran. A job
        whose prompt chunk did not fit this step's budget is left waiting in its greenlet (`waiting`)."""
        self.hub, self.round = getcurrent(), self.round + 1
        try:
            return self._run(steps)
        finally:
            self.hub = None

    def _run(self, steps: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], Step]:
        done: dict[str, Any] = {}
        step = Step()
        # jobs still waiting from an earlier step (a prompt chunk the budget left out) keep their request
        runnable = {job: (self._task(fn), _START) for job, fn in steps.items() if job not in self.waiting}
        fed = False
        while runnable or (not fed and any(r.kind in STEPPED for _, r in self.waiting.values())):
            asked: dict[str, tuple[greenlet, Request]] = {}
            for job, (task, answer) in runnable.items():
                out = task.switch() if answer is _START else task.switch(answer)
                if task.dead:
                    done[job] = out
                else:
                    asked[job] = (task, out)
            self.waiting.update(asked)
            runnable = self._answer_heads(step)
            if not runnable and not fed:
                runnable, fed = self._answer_feeds(step), True
        return done, step

    @staticmethod
    def _task(fn: Callable[[], Any]) -> greenlet:
        def body():
            try:
                return fn()
            except BaseException as e:  # noqa: BLE001 -- handed to the loop, which closes the job
                return e
        return greenlet(body)

    def _answer_heads(self, step: Step) -> dict[str, tuple[greenlet, Any]]:
        heads = {job: (task, r) for job, (task, r) in self.waiting.items() if r.kind == "head"}
        if not heads:
            return {}
        for job in heads:
            del self.waiting[job]
        import torch

        started = time.perf_counter()
        try:
            logits = self.model.head(torch.stack([r.args[0] for _, r in heads.values()]))
            return {job: (task, logits[i]) for i, (job, (task, _)) in enumerate(heads.items())}
        except Exception as e:  # noqa: BLE001 -- every asker gets it
            return {job: (task, e) for job, (task, _) in heads.items()}
        finally:
            step.model_s += time.perf_counter() - started

    def _answer_feeds(self, step: Step) -> dict[str, tuple[greenlet, Any]]:
        answers = self._answer_alone(step)
        feeds = sorted(((job, task, r) for job, (task, r) in self.waiting.items() if r.kind == "feed"),
                       key=lambda f: (f[2].rows > 1, f[2].arrived))
        chosen = self._choose(feeds)
        if not chosen:
            return answers
        step.sessions = len(chosen)
        step.decode_rows += sum(1 for _, _, r, _ in chosen if r.rows == 1)
        step.prefill_rows += sum(piece.rows for _, _, r, piece in chosen if r.rows > 1)
        for job, task, r, piece in chosen:
            if piece is r:
                del self.waiting[job]
            else:  # the rest of its chunk waits for the next step
                ids, pos, cache = r.args
                self.waiting[job] = (task, replace(r, args=(ids[piece.rows:], pos + piece.rows, cache)))
        t = time.perf_counter()
        try:
            hidden = self.model.feed_rows([piece.args for _, _, _, piece in chosen])
        except Exception:  # noqa: BLE001 -- one item's error (its context, its cache) must not fail the others
            hidden = [_alone(self.model, piece) for _, _, _, piece in chosen]
        else:
            self.pace.observe(step.decode_rows, step.prefill_rows, time.perf_counter() - t)
        step.model_s += time.perf_counter() - t
        for i, (job, task, r, piece) in enumerate(chosen):
            if piece is r or isinstance(hidden[i], BaseException):
                self.waiting.pop(job, None)
                answers[job] = (task, hidden[i])
        return answers

    def _answer_alone(self, step: Step) -> dict[str, tuple[greenlet, Any]]:
        """The oldest waiting call that is computed by itself ("alone"), computed: one a step."""
        alone = [(job, task, r) for job, (task, r) in self.waiting.items() if r.kind == "alone"]
        if not alone:
            return {}
        job, task, r = min(alone, key=lambda a: a[2].arrived)
        del self.waiting[job]
        started = time.perf_counter()
        try:
            out = r.args[0]()
        except Exception as e:  # noqa: BLE001 -- handed to its job
            out = e
        step.model_s += time.perf_counter() - started
        return {job: (task, out)}

    def _choose(self, feeds: list) -> list[tuple[str, greenlet, Request, Request]]:
        """(job, task, request, what of it this step feeds): every decode token, then prompt rows, oldest
        first, within the pace beside decode tokens or `step_tokens` without them (module docstring)."""
        decode = [(job, task, r, r) for job, task, r in feeds if r.rows == 1]
        prompts = [(job, task, r) for job, task, r in feeds if r.rows > 1]
        room = self.pace.rows(len(decode)) if decode else self.step_tokens
        chosen = list(decode)
        for job, task, r in prompts:
            if room <= 0:
                break
            if r.rows <= room:
                chosen.append((job, task, r, r))
            elif self.cut and decode:
                ids, pos, cache = r.args
                chosen.append((job, task, r, replace(r, args=(ids[:room], pos, cache))))
            elif len(chosen) == len(decode):  # the oldest chunk goes whole rather than wait for ever
                chosen.append((job, task, r, r))
            else:
                continue
            room -= chosen[-1][3].rows
        return chosen


_START = object()  # a new step: its greenlet starts with no answer


def _alone(model, r: Request):
    try:
        return model.feed(*r.args)
    except Exception as e:  # noqa: BLE001
        return e
