"""AsyncLLM's table of unfinished requests, kept on the event loop: three ids lead to one request.

    caller's id "chat-1"  --(one at a time)-->  internal id "chat-1-7"  -->  LiveRequest
    core ids "0_chat-1-7", "1_chat-1-7" (n=2)  ------------------------------^

A caller's id is reserved while its prompt is tokenized (so a second request with the same id is
refused at once) and free again the moment its request ends; the internal id (caller's id and a
sequence number) keeps a late output of the old request away from a new one with the same id.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagedllm.engine.output_stream import LiveRequest


class LiveRequests:
    def __init__(self) -> None:
        self._live: dict[str, LiveRequest] = {}  # internal id -> request
        self._ids_in_use: dict[str, str | None] = {}  # caller's id -> internal id (None: tokenizing)
        self._core_owner: dict[str, str] = {}  # core id -> internal id

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveRequest]:
        return iter(list(self._live.values()))

    def reserve(self, request_id: str) -> None:
        """Hold the caller's id while its request is prepared; ValueError when it is in use."""
        if request_id in self._ids_in_use:
            raise ValueError(f"request id {request_id!r} is already in use.")
        self._ids_in_use[request_id] = None

    def release(self, request_id: str) -> None:
        """Give back an id `reserve` held for a request that was never registered."""
        if self._ids_in_use.get(request_id) is None:
            self._ids_in_use.pop(request_id, None)

    def register(self, live: LiveRequest) -> None:
        self._live[live.internal_id] = live
        self._ids_in_use[live.request_id] = live.internal_id
        for cid in live.core_ids:
            self._core_owner[cid] = live.internal_id

    def is_live(self, live: LiveRequest) -> bool:
        return self._live.get(live.internal_id) is live

    def get(self, internal_id: str) -> LiveRequest | None:
        return self._live.get(internal_id)

    def by_request_id(self, request_id: str) -> LiveRequest | None:
        """The unfinished request the caller knows as `request_id`."""
        internal_id = self._ids_in_use.get(request_id)
        return self._live.get(internal_id) if internal_id is not None else None

    def owner_of(self, core_id: str) -> LiveRequest | None:
        internal_id = self._core_owner.get(core_id)
        return self._live.get(internal_id) if internal_id is not None else None

    def forget(self, live: LiveRequest) -> None:
        del self._live[live.internal_id]
        if self._ids_in_use.get(live.request_id) == live.internal_id:
            del self._ids_in_use[live.request_id]
        for cid in live.core_ids:
            self._core_owner.pop(cid, None)

    def clear(self) -> None:
        self._live.clear()
        self._ids_in_use.clear()
        self._core_owner.clear()
