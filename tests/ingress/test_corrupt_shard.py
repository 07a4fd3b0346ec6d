"""A model file corrupted on disk after the app is up, seen over real HTTP (over the in-process cluster).

The ingress reads only the `.zqs` header at its start; every actor reads the file again at its cold
start (policy max_hot_short_actors=0: every request starts a fresh actor). A corrupt file is a
server-side fault: the request ends with a documented 5xx error carrying its request id — never a
hang, never a success with garbage — within a bound, the failed actor is forgotten and killed, nothing
stays reserved, and once the good file is back a request is served again.

Classes, and the ending each gets:
  - bytes flipped inside a layer's frame: its CRC-32 fails when the layer loads, after the actor sent
    `Started` — 500 api_error, or, for a stream, an api_error event after message_start and before any text;
  - bytes flipped inside the raw embedding table: the prompt's rows are read unchecked, so the table's
    CRC must fail before any token — the same ending;
  - the file cut in the middle of a layer (the header no longer fits the file) or gone: the actor's
    constructor raises — the same on any placement, so it is not retried: 500 api_error (JSON, also for
    a stream, since nothing was sent yet).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.ingress.local import assert_nothing_left, serve_locally
from tests.reliability.harness import body, call
from tests.serve.waiting import wait_for
from weights_tool.reader import ShardReader

START_TIMEOUT_S = 30.0  # a cold actor's first token; the tiny model loads well within it on any CI machine
# What a corrupt model file answers: a server-side fault (serve_app/errors.py), 500 api_error, whether the
# actor raised while it loaded (a frame's check failed) or in its constructor (the file missing or cut
# short of what its header declares). Never a 503: retrying elsewhere cannot help.
SERVER_FAULTS = {(500, "api_error")}
STREAM_FAULTS = {"api_error"}  # the same, as a stream's error event after its start


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, tiny_zqs) -> Path:
    """A copy of the tiny model the deployment serves, and the tests corrupt."""
    path = tmp_path_factory.mktemp("corrupt-shard") / "tiny.zqs"
    shutil.copyfile(tiny_zqs, path)
    return path


@pytest.fixture(scope="module")
def zq(model_file):
    server = serve_locally(model_file, start_timeout_s=START_TIMEOUT_S, policy={"max_hot_short_actors": 0})
    assert call(server.base, body(max_tokens=2)).is_complete
    yield server
    server.stop()


def _frame(path: Path, group: str):
    with ShardReader(path) as r:
        return r.group(group).frames[0]


def _replace(path: Path, data: bytes) -> None:
    """`path` now holds `data`: written beside it, then renamed over it (no reader sees a partial file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _flip(path: Path, group: str) -> None:
    frame = _frame(path, group)
    raw = bytearray(path.read_bytes())
    raw[frame.offset + frame.stored_size // 2] ^= 0xFF
    _replace(path, bytes(raw))


def _truncate(path: Path) -> None:
    frame = _frame(path, "layer.1")
    _replace(path, path.read_bytes()[:frame.offset + frame.stored_size // 2])


def _delete(path: Path) -> None:
    path.rename(path.with_suffix(".gone"))


CORRUPTIONS = {
    "layer-bytes-flipped": lambda p: _flip(p, "layer.1"),
    "embedding-bytes-flipped": lambda p: _flip(p, "embed"),
    "truncated-mid-layer": _truncate,
    "deleted": _delete,
}


@pytest.fixture
def restore(model_file):
    good = model_file.read_bytes()
    yield
    model_file.with_suffix(".gone").unlink(missing_ok=True)
    _replace(model_file, good)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_model_file_is_a_documented_server_error_then_served_again_once_restored(
        zq, model_file, restore, corruption, stream):
    server, zq = zq, zq.base
    good = model_file.read_bytes()
    CORRUPTIONS[corruption](model_file)

    ending = call(zq, body(max_tokens=8, stream=stream))
    assert ending.request_id and ending.error_request_id == ending.request_id, (corruption, ending)
    assert not ending.text, ending  # not one token computed from a corrupt file
    if ending.status == 200:
        # A stream whose actor had sent `Started` (its header and first layers were fine) when a bad frame
        # failed its check: an error event ends it, before any text.
        assert stream and ending.error_type in STREAM_FAULTS, (corruption, ending)
        types = [e["type"] for e in ending.events]
        assert types[:2] == ["message_start", "content_block_start"] and types[-1] == "error", types
        assert set(types[2:-1]) <= {"ping"}, types
    else:
        # Refused before any event (the actor failed before `Started`): a JSON error with its status.
        assert (ending.status, ending.error_type) in SERVER_FAULTS, (corruption, ending)
        assert not ending.events
    assert_nothing_left(server)  # the failed actors forgotten and killed, no reservation
    # No hot actor is kept and no warm pool is filled here: every actor this request started is gone.
    wait_for(lambda: not server.actor_names(), 30, "the failed actors killed")

    model_file.with_suffix(".gone").unlink(missing_ok=True)
    _replace(model_file, good)
    ending = call(zq, body(max_tokens=8, stream=stream))
    # Complete; its text may be empty: a random-weight model samples ids the synthetic tokenizer has no text for.
    assert ending.is_complete, ending
    assert_nothing_left(server)
