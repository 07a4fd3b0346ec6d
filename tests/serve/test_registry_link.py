"""A request's calls to the registry outlive the request, on real Ray: when a client leaves, Serve cancels the
request and Ray cancels every task the request submitted that has not run yet. Calls made through
`RegistryLink.call` are no request's children, so the registry still hears the request's `finish`."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from serve_app.ray_cluster.registry_link import RegistryLink


@ray.remote(max_concurrency=1)
class Books:
    """A registry's books in miniature: what each call told it."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def finish(self, note: str) -> str:
        self.notes.append(note)
        return note

    def read(self) -> list[str]:
        return list(self.notes)


@ray.remote
class Gate:
    """The call's argument, pending until the test opens it: the call waits for it at the caller, where the
    request's cancellation finds it (a timed argument could resolve first on a loaded machine)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()

    async def value(self, value: str) -> str:
        await self._open.wait()
        return value

    async def open(self) -> None:
        self._open.set()


@ray.remote
class Replica:
    """An async actor, as a Serve replica is: each request is a task, its calls submitted while it runs."""

    def __init__(self, books) -> None:
        self.link = RegistryLink(lambda: books, "replica-1")
        self.is_running = False

    async def request(self, pending: list, through_link: bool) -> None:
        if through_link:
            self.link.call("finish", pending[0])
        else:
            self.link.handle.finish.remote(pending[0])
        self.is_running = True
        await asyncio.sleep(60)  # the client's stream, until the client leaves

    async def running(self) -> bool:
        return self.is_running

    async def later_call(self) -> str:
        """A later call from this replica: the registry runs one caller's calls in the order they were made."""
        return await self.link.call("finish", "later")


def _finish_after_the_client_left(through_link: bool) -> list[str]:
    books, gate = Books.remote(), Gate.remote()
    replica = Replica.remote(books)
    pending = gate.value.remote("finished")  # created here, so the cancel below does not take it too
    call = replica.request.remote([pending], through_link)
    deadline = time.monotonic() + 60
    while not ray.get(replica.running.remote(), timeout=60):  # its finish made, waiting for its argument
        assert time.monotonic() < deadline, "the request did not start"
        time.sleep(0.05)
    ray.cancel(call)  # what Serve does when the client leaves; recursive, as Serve's is
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(call, timeout=60)  # the request is cancelled, and with it its children
    ray.get(gate.open.remote(), timeout=30)  # only now can the finish, if it lives, be sent
    assert ray.get(replica.later_call.remote(), timeout=60) == "later"  # after the finish, if it lives
    notes = ray.get(books.read.remote(), timeout=30)
    for handle in (replica, books, gate):
        ray.kill(handle)
    return notes


@pytest.mark.usefixtures("ray_cluster")
def test_a_call_through_the_link_reaches_the_registry_after_the_clients_request_was_cancelled():
    assert _finish_after_the_client_left(through_link=True) == ["finished", "later"]


@pytest.mark.usefixtures("ray_cluster")
def test_a_call_submitted_plainly_within_the_request_is_cancelled_with_it():
    # Ray's behaviour that the link works around: were it to change, the link's empty context would be moot.
    assert _finish_after_the_client_left(through_link=False) == ["later"]
