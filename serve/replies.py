"""A reply as the engine sends it: one event per generated token, with the text it releases.

`Tokens` is the file-like that a session's trace writer writes to (one JSON line per generated
token: position, id, logits hash, and its log-probabilities when the client asked for them, which
`Tokens.logprobs` turns into OpenAI's entry for the token); `ReplyText` holds back text that could
begin a stop string and cuts the reply where one appears (OpenAI leaves stop strings out of the
reply). The events of a reply are a function of its tokens alone, so a stream that is resumed after
position p replays the reply from its start and sends only what comes after p: the client gets
exactly the rest.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Iterable, Iterator


class Tokens:
    """Collects the trace lines the library writes while it generates (`trace=` argument). `digests`:
    whether the lines carry the logits' hashes (TraceWriter computes them only then); a reply sends
    them only to a client that asked for the trace. `top_logprobs`: None, or how many likeliest
    tokens each line lists beside the token's own log-probability (TraceWriter computes them then),
    named by `tokenizer`."""

    def __init__(self, digests: bool = True, top_logprobs: int | None = None, tokenizer=None):
        self.lines: list[dict[str, Any]] = []
        self.digests = digests
        self.top_logprobs = top_logprobs
        self.named = lru_cache(maxsize=4096)(lambda token: _token_name(tokenizer, token))

    @classmethod
    def for_job(cls, job: dict[str, Any], tokenizer=None) -> "Tokens":
        """The collector of a job's reply: hashes unless the client did not ask for the trace,
        log-probabilities where it asked for them (`job["logprobs"]`: how many alternatives)."""
        return cls(digests=job.get("trace", True), top_logprobs=job.get("logprobs"), tokenizer=tokenizer)

    def logprobs(self, line: dict[str, Any]) -> dict[str, Any] | None:
        """OpenAI's logprobs entry of a line's token (`{"token", "bytes", "logprob", "top_logprobs"}`),
        or None where the line has none (not asked for, or a stored token replayed, not computed)."""
        if "logprob" not in line:
            return None
        return {**self.named(line["token"]), "logprob": line["logprob"],
                "top_logprobs": [{**self.named(t), "logprob": lp} for t, lp in line["top_logprobs"]]}

    def prompt_entry(self, entry: dict[str, Any] | None, token: int) -> dict[str, Any]:
        """A scored prompt token's entry (`Session.append_scored`'s; None: a token that nothing before it
        predicts, a session's first: its logprob and alternatives are null, as OpenAI's echo gives them)."""
        if entry is None:
            return {**self.named(token), "logprob": None, "top_logprobs": None}
        return self.logprobs(entry)

    def write(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                self.lines.append(json.loads(line))

    def flush(self) -> None:
        pass


class ReplyText:
    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """The text that `piece` releases (nothing once a stop string was seen)."""
        if self.stopped:
            return ""
        self.pending += piece
        cuts = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if cuts:
            out, self.pending, self.stopped = self.pending[:min(cuts)], "", True
            return out
        keep = min(self.hold, len(self.pending))
        out, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        out = "" if self.stopped else self.pending
        self.pending = ""
        return out


def token_events(pieces: Iterator[str], tokens: Tokens, text: ReplyText, after: int = -1) -> Iterator[dict[str, Any]]:
    """Events `{"event": "token", "position", "token", "logits_sha256", "text"}` for the tokens a
    generation writes to `tokens` while `pieces` yields its text, only those past position `after`;
    then `{"event": "tail", "text"}`: what was held back until the end (the reply's last characters).
    An empty piece with no token (`Session.prefill_yields`: a prefill chunk done) is `{"event": "prefill"}`."""
    sent, carry = 0, ""
    for piece in pieces:
        if not piece and len(tokens.lines) == sent:
            yield {"event": "prefill"}  # a prefill chunk is done: the engine runs another job's step
            continue
        carry += text.push(piece)
        new, sent = tokens.lines[sent:], len(tokens.lines)
        for i, line in enumerate(new):
            last = i == len(new) - 1
            if line["position"] > after:
                yield token_event(line, carry if last else "", tokens)
            if last:
                carry = ""
    for line in tokens.lines[sent:]:  # tokens that released no piece (EOS, say)
        if line["position"] > after:
            yield token_event(line, "", tokens)
    yield {"event": "tail", "text": carry + text.flush()}


def token_event(line: dict[str, Any], text: str, tokens: Tokens) -> dict[str, Any]:
    event = {"event": "token", "position": line["position"], "token": line["token"],
             "logits_sha256": line.get("logits_sha256"), "text": text}
    if tokens.top_logprobs is not None:
        event["logprobs"] = tokens.logprobs(line)
    return event


def _token_name(tokenizer, token: int) -> dict[str, Any]:
    """A token as OpenAI's logprobs name it: its text and its bytes (a token may hold part of a
    character: its text then has U+FFFD where the bytes are exact)."""
    raw = tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}


def stored_pieces(decoder, ids: list[int], start: int, tokens: Tokens, skip: frozenset = frozenset()) -> Iterator[str]:
    """The text pieces of stored reply tokens `ids` (from position `start`), each recorded in
    `tokens` as the trace writer would (without a logits hash or log-probabilities: they were not
    computed again)."""
    for offset, token in enumerate(ids):
        tokens.lines.append({"position": start + offset, "token": token, "logits_sha256": None})
        if token not in skip and (piece := decoder.push(token)):
            yield piece
