"""The engine's side of the store beside it: save sealed blocks, prepare a prefix, fetch pages.

Blocking gRPC on loopback (the engine's connector hooks are synchronous):
``Save``, ``Prepare``, ``Locate`` and ``Attach`` on the store's control
service (`kvmesh.v1.EngineStore`, msgpack bodies), pages out of its page
server with ``FetchPages`` (`kvmesh.v1.KVWorker`, protobuf `PageChunk`
messages, raw bytes) when its shared-memory arena cannot be used
(`kvmesh.connector.block_path` picks the path). Every call
has a deadline; a store that is down or too slow raises `TransportError`,
a refused call the store's own error (`HashMismatch`, `PageFormatError`...);
the connector turns either into a miss (load) or a skipped save, never a
failed request. Imports only the base and the proto.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import msgpack

from kvmesh.connector.blocks import BlockRun
from kvmesh.errors import InvalidInput, TransportError
from kvmesh.grpc_security import error_from_rpc
from kvmesh.page_arena import ArenaLayout
from kvmesh.proto import kvmesh_pb2 as pb

CONTROL_SERVICE = "kvmesh.v1.EngineStore"
PAGE_SERVICE = "kvmesh.v1.KVWorker"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
RECONNECT_BACKOFF_MS = (100, 1000)  # first and longest wait before redialling the store


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `Prepare` answered: leading blocks the store holds now, how many it pulled, from whom."""

    held: int
    pulled: int
    source: str | None


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """The store's page format and hash, which must match the engine's."""

    page_bytes: int
    block_size: int
    algo: str
    root_hash: bytes
    arena: ArenaLayout | None = None
    peers: tuple[str, ...] = ()  # the store's own peers (it pulls from them when asked)


@dataclass(frozen=True, slots=True)
class Located:
    """What `Locate` answered: the arena's token and the slots of the leading pages held."""

    arena: bytes | None
    slots: tuple[int, ...]


class StoreClient:
    """One engine's connection to its store: a page address and a control address."""

    def __init__(self, page_address: str, control_address: str, timeout_s: float = 5.0) -> None:
        if not page_address or not control_address:
            raise InvalidInput(
                "the kvmesh connector needs the store's page and control addresses "
                '(kv_connector_extra_config {"store": "host:port", "control": "host:port"})'
            )
        if timeout_s <= 0:
            raise InvalidInput(f"timeout_s must be positive, got {timeout_s}")
        self.page_address = page_address
        self.control_address = control_address
        self.timeout_s = timeout_s
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a restarted store on loopback is found again within a second (gRPC's default
            # backoff grows to 120 s, which would leave the engine without its store)
            ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
            ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ]
        self._control = grpc.insecure_channel(control_address, options=options)
        self._pages = grpc.insecure_channel(page_address, options=options)
        self._save = self._control.unary_unary(f"/{CONTROL_SERVICE}/Save")
        self._prepare = self._control.unary_unary(f"/{CONTROL_SERVICE}/Prepare")
        self._describe = self._control.unary_unary(f"/{CONTROL_SERVICE}/Describe")
        self._forget = self._control.unary_unary(f"/{CONTROL_SERVICE}/Forget")
        self._locate = self._control.unary_unary(f"/{CONTROL_SERVICE}/Locate")
        self._attach = self._control.unary_unary(f"/{CONTROL_SERVICE}/Attach")
        self._fetch = self._pages.unary_stream(
            f"/{PAGE_SERVICE}/FetchPages",
            request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=pb.PageChunk.FromString,
        )

    def close(self) -> None:
        self._control.close()
        self._pages.close()

    def _call(self, method: Callable[..., bytes], body: dict[str, Any]) -> dict[str, Any]:
        try:
            raw = method(msgpack.packb(body, use_bin_type=True), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "engine store call", self.control_address) from None
        answer = msgpack.unpackb(raw, raw=False)
        if not isinstance(answer, dict):
            raise TransportError(f"engine store {self.control_address} answered {type(answer)}")
        return answer

    def describe(self) -> StoreInfo:
        a = self._call(self._describe, {})
        arena = a.get("arena")
        return StoreInfo(
            a["page_bytes"],
            a["block_size"],
            a["algo"],
            a["root_hash"],
            None if arena is None else ArenaLayout.from_wire(arena),
            tuple(str(p) for p in a.get("peers") or ()),
        )

    def save(
        self, run: BlockRun, pages: Sequence[bytes], touched: Sequence[bytes] = ()
    ) -> list[bool]:
        """Hand sealed blocks to the store; per block whether it was new there.

        `touched`: blocks this engine loaded since its last save (read from the
        arena's directory, no call), which the store first touches as hits.
        """
        body = {**run.wire(), "pages": list(pages), "touched": list(touched)}
        return list(self._call(self._save, body)["inserted"])

    def save_staged(
        self, run: BlockRun, lease: bytes, slots: Sequence[int], touched: Sequence[bytes] = ()
    ) -> list[bool]:
        """`save` for sealed blocks written into the staging `slots` this client's `lease` holds."""
        body = {**run.wire(), "lease": lease, "slots": list(slots), "touched": list(touched)}
        return list(self._call(self._save, body)["inserted"])

    def attach(self) -> bytes:
        """Lease the store's staging slots (ending any other client's lease); the lease."""
        return bytes(self._call(self._attach, {})["lease"])

    def locate(self, digests: Sequence[bytes]) -> Located:
        """Arena slots of the leading `digests` the store holds (nothing pinned)."""
        a = self._call(self._locate, {"digests": list(digests)})
        arena = a.get("arena")
        slots = tuple(int(s) for s in a["slots"])
        return Located(None if arena is None else bytes(arena), slots)

    def prepare(
        self, run: BlockRun, peers: Sequence[str] = (), peer_controls: Sequence[str] = ()
    ) -> Prepared:
        """Ask the store to hold `run` (pulling from `peers` what it lacks; from the arenas of
        those whose control address `peer_controls` names, when it maps them)."""
        body = {**run.wire(), "peers": list(peers), "peer_controls": list(peer_controls)}
        a = self._call(self._prepare, body)
        return Prepared(int(a["held"]), int(a["pulled"]), a.get("source"))

    def forget(self, digests: Sequence[bytes]) -> int:
        """Ask the store to drop blocks that failed their check here; how many it held."""
        return int(self._call(self._forget, {"digests": list(digests)})["forgotten"])

    def fetch(self, digests: Sequence[bytes]) -> list[bytes | None]:
        """The stored pages of `digests`, in order; None for a page the store no longer holds.

        Raises `TransportError` when the stream fails (the store died, a
        deadline passed); pages are whole or absent, never partial.
        """
        pages: list[bytearray | None] = [None] * len(digests)
        sizes = [0] * len(digests)
        filled = [0] * len(digests)
        request = pb.FetchRequest(page_hashes=list(digests))
        try:
            for chunk in self._fetch(request, timeout=self.timeout_s):
                i = chunk.page_index
                if not 0 <= i < len(digests):
                    raise TransportError(f"store sent page index {i} for {len(digests)} asked")
                if chunk.missing:
                    continue
                if chunk.HasField("header"):
                    if chunk.header.page_hash != digests[i]:
                        raise TransportError(f"store sent another page at index {i}")
                    sizes[i] = chunk.header.nbytes
                    pages[i] = bytearray(sizes[i])
                buf = pages[i]
                if buf is None or chunk.offset + len(chunk.data) > sizes[i]:
                    raise TransportError(f"store sent bytes past page {i}'s end")
                buf[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
                filled[i] += len(chunk.data)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "FetchPages", self.page_address) from None
        return [
            bytes(p) if p is not None and filled[i] == sizes[i] else None
            for i, p in enumerate(pages)
        ]
