"""The store's troubles under a live `kvstore serve`: a full disk (really full, not a mock) and a
damaged file.

For the full disk the server runs in a mount namespace of its own with its home on a small tmpfs
(`unshare -rm`; skipped where that is not allowed), and the test fills that tmpfs through the
server's own view of it (`/proc/PID/root`). What a user may expect, and what is checked:

- a request that must write (a turn on a stored session, a new session, a request of its own) is a
  507 in OpenAI's error shape (`server_error`, code `store_full`, a message that says the disk is
  full and to try again later, not the operator's commands), never a 500; streamed, before any output it is that HTTP status, after some output an
  `{"error": ...}` event that ends the stream;
- nothing is lost and nothing is half-written: the session reads back as it was, the server and
  its engine stay up (same process), reading (GET) still works;
- once there is room again, the same requests succeed and the conversation goes on exactly: the
  turns' trace hashes equal the library's for the same conversation, and a stream cut by the full
  disk, resent with `Last-Event-ID`, is finished so that the whole equals an uncut reply; resent
  without it (a retry), the reply is that uncut reply whole, not a second answer on a branch.

A session whose stored KV was damaged (a flipped byte, found by its checksum when the server
restores it) is a 422 `corrupt_data` that names the session and no path of the server's, and says
what the client can do (delete it, or continue from a fork); the server, its engine and the other
sessions go on, and the damaged session can still be read and deleted.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import httpx
import openai
import pytest

import kvstore
import store_harness as H
from serve_kit import LiveServer
from test_serve_chat import (CHUNK, TURNS, chat, library_conversation, long_request, model_folder,  # noqa: F401
                             retried_whole, sse_events, stream_events, text_of, tokens_of)

DISK = "48m"  # the tmpfs under the server's home: the tiny model's sessions take a few MB


class Disk:
    """The server's home as its processes see it: their mount namespace's tmpfs, through /proc."""

    def __init__(self, server: LiveServer):
        self.home = Path(f"/proc/{server.process.pid}/root") / str(server.home).lstrip("/")
        self.filler = self.home / "filler"

    def free_bytes(self) -> int:
        st = os.statvfs(self.home)
        return st.f_bavail * st.f_frsize

    def fill(self) -> None:
        """Write until ENOSPC with ever smaller writes: not a byte left."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 1 << 12, 1):
                block = b"\0" * size
                while True:
                    try:
                        os.write(fd, block)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC, e
                        break
        finally:
            os.close(fd)
        assert self.free_bytes() == 0

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_folder):  # noqa: F811 (the fixture imported above)
    why = H.tmpfs_refused()
    if why:
        pytest.skip(f"a real full disk needs a tmpfs of the server's own: {why}")
    home = tmp_path_factory.mktemp("full") / "home"
    home.mkdir()
    mount = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size={DISK} tmpfs "$0" && exec "$@"', str(home)]
    with LiveServer(home, model_folder, "--chunk-size", str(CHUNK), "--threads", "1", "--checkpoint-every", "4",
                    wrap=mount) as s:
        yield s


@pytest.fixture
def disk(server):
    d = Disk(server)
    yield d
    d.free()


def store_full(error: openai.APIStatusError) -> None:
    """A 507 in OpenAI's error shape that says what happened."""
    assert error.status_code == 507, error
    body = error.response.json()["error"]
    assert body["type"] == "server_error" and body["code"] == "store_full", body
    assert "disk is full" in body["message"] and "Traceback" not in error.response.text, body
    assert "try again later" in body["message"].lower() and "kvstore gc" not in body["message"], body  # the client's advice


def test_a_full_disk_is_a_507_that_loses_nothing_and_the_conversation_goes_on_exactly(server, disk, model_folder,
                                                                                     tmp_path):
    client, http = server.client(), server.http()
    engines = server.engine_pids()
    messages = [{"role": "user", "content": TURNS[0]}]
    first = chat(client, "notes", messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    stored = http.get("/v1/sessions/notes").json()
    listed = http.get("/v1/sessions").json()

    disk.fill()
    with pytest.raises(openai.APIStatusError) as turn:  # the next turn must write its KV
        chat(client, "notes", messages)
    store_full(turn.value)
    with pytest.raises(openai.APIStatusError) as streamed:  # before any output: the status, not a broken 200
        list(chat(client, "notes", messages, stream=True))
    store_full(streamed.value)
    with pytest.raises(openai.APIStatusError) as new:  # a session that does not exist yet
        chat(client, "fresh", [{"role": "user", "content": TURNS[0]}])
    store_full(new.value)
    with pytest.raises(openai.APIStatusError) as own:  # a request of its own (the prefix cache's entry)
        chat(client, None, [{"role": "user", "content": TURNS[0]}])
    store_full(own.value)
    assert http.get("/v1/sessions/notes").json() == stored  # reading works, and nothing moved
    assert http.get("/v1/sessions").json() == listed
    assert server.health()["status"] == "ok" and server.engine_pids() == engines  # nothing crashed

    disk.free()
    second = chat(client, "notes", messages)
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": TURNS[2]}]
    third = chat(client, "notes", messages)
    assert library_conversation(model_folder, tmp_path / "lib", TURNS) == \
        [first.kvstore["trace"], second.kvstore["trace"], third.kvstore["trace"]]
    assert chat(client, "fresh", [{"role": "user", "content": TURNS[0]}]).kvstore["trace"] == first.kvstore["trace"]
    assert server.engine_pids() == engines


def cut_by_a_full_disk(server, disk, name: str) -> list:
    """The events of a long streamed reply on session `name` during which the disk fills (after 20
    events): they end with the error event that says so."""
    filled = []

    def fill_at_20(out):
        if len(out) == 20 and not filled:
            disk.fill()
            filled.append(True)

    with httpx.stream("POST", server.url + "/v1/chat/completions", json=long_request(name), timeout=120) as r:
        assert r.status_code == 200
        got = sse_events(r.iter_lines(), fill_at_20)
    assert filled
    error = got[-1][1]["error"]  # the stream's last event: what stopped it, in OpenAI's shape
    assert error["code"] == "store_full" and error["type"] == "server_error" and "disk is full" in error["message"]
    assert "kvstore gc" not in error["message"]
    return got


def test_a_stream_cut_by_a_full_disk_ends_with_an_error_event_and_is_finished_once_there_is_room(server, disk):
    whole = stream_events(server, long_request("uncut-stream"), {})
    assert len(tokens_of(whole)) > 40
    got = cut_by_a_full_disk(server, disk, "cut-stream")
    assert len(tokens_of(got)) < len(tokens_of(whole))

    disk.free()
    last_id = [i for i, _ in got if i][-1]
    rest = stream_events(server, long_request("cut-stream"), {"Last-Event-ID": last_id})
    assert rest[-1][1] is None  # [DONE]
    assert text_of(got[:-1]) + text_of(rest) == text_of(whole)
    assert tokens_of(got) + tokens_of(rest) == tokens_of(whole)


def test_a_reply_cut_by_a_full_disk_and_retried_without_last_event_id_is_that_reply_whole(server, disk):
    """A client that got the error and sends the same request again once there is room, not
    streamed and without Last-Event-ID (as clients that retry do), gets the reply it would have had:
    the cut one finished, no second answer on a branch."""
    whole = stream_events(server, long_request("uncut-retry"), {})
    got = cut_by_a_full_disk(server, disk, "cut-retry")
    assert 0 < len(tokens_of(got)) < len(tokens_of(whole))

    disk.free()
    retried_whole(server, "cut-retry", whole)


# -- a damaged file ---------------------------------------------------------------------------------
def test_a_damaged_session_is_a_422_and_the_server_goes_on(tmp_path, model_folder):  # noqa: F811
    home = tmp_path / "home"
    messages = [{"role": "user", "content": TURNS[0]}]
    with LiveServer(home, model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        client = server.client()
        first = chat(client, "doc", messages)
        chat(client, "other", messages)
    with kvstore.open_store(home) as store:
        folder = store.session_dir(store.info("doc").id)
    H.flip_byte(folder / "layer-001.kv", 100)  # in the first extent's bytes (extents begin at aligned offsets)

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    with LiveServer(home, model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        client, http = server.client(), server.http()
        engines = server.engine_pids()
        for stream in (False, True):
            with pytest.raises(openai.UnprocessableEntityError) as damaged:
                reply = chat(client, "doc", messages, stream=stream)
                list(reply) if stream else None
            error = damaged.value.response.json()["error"]
            assert error["code"] == "corrupt_data" and error["type"] == "invalid_request_error", error
            assert "'doc'" in error["message"] and "checksum" in error["message"], error
            # what the client can do, not the operator's command line
            assert "DELETE /v1/sessions/doc" in error["message"] and "export" not in error["message"], error
            assert str(home) not in error["message"] and "Traceback" not in damaged.value.response.text
        assert http.get("/v1/sessions/doc").status_code == 200  # its record reads back
        again = chat(client, "other", messages)  # another session (its first turn was the same) goes on
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert server.health()["status"] == "ok" and server.engine_pids() == engines
        assert http.delete("/v1/sessions/doc").status_code == 200  # and the damaged one can go
        assert chat(client, "doc", messages[:1]).kvstore["trace"] == first.kvstore["trace"]
