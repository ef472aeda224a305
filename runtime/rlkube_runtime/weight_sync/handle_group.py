"""The trainer ranks that hand one colocated engine its weights when it spans several GPUs.

SGLang's /update_weights_from_tensor takes one payload per tensor-parallel rank: rank i opens
payload i, which must point at memory on its own GPU and hold the whole tensors (each rank cuts
its own shard). The engine over GPUs g0..gk-1 shares them with trainer ranks r0..rk-1, so per
bucket every one of those ranks stages the bucket on its GPU and pickles its handles; the first
(the leader) collects the others' payloads and posts all k in one request, then tells each rank
whether the engine took them, so it may reuse its staging buffer.

The payloads (a few kilobytes of handles each) go through the trainer ranks' rendezvous store,
not a process group: the members need no collective with the ranks of other engines, and a
member that fails tells the others so in the store instead of leaving them in a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

EXCHANGE_TIMEOUT = datetime.timedelta(minutes=10)
_FAILED = "!failed: "


class HandleGroupError(RuntimeError):
    """The engine did not take a bucket (or a member could not stage one); every member stops."""


@dataclasses.dataclass(frozen=True)
class HandleGroup:
    """This rank's place among the `size` ranks giving engine `engine` its handles: `position` is
    the engine's tensor-parallel rank on this rank's GPU (0: the leader, which posts). `store`: a
    torch.distributed Store all of them reach (the trainer ranks' rendezvous store)."""

    store: Any
    engine: int
    position: int
    size: int
    timeout: datetime.timedelta = EXCHANGE_TIMEOUT

    @property
    def leader(self) -> bool:
        return self.position == 0

    def _key(self, version: str, bucket: int, what: str, rank: int) -> str:
        return f"rlkube/handles/engine{self.engine}/v{version}/b{bucket}/{what}/{rank}"

    def _wait(self, key: str) -> str:
        self.store.wait([key], self.timeout)
        value = self.store.get(key).decode()
        self.store.delete_key(key)
        return value

    # -- the leader --------------------------------------------------------------------------

    def collect(self, version: str, bucket: int, own: str) -> list[str]:
        """Every member's payload for `bucket`, in tensor-parallel rank order (the leader's `own`
        first); raises HandleGroupError (after telling the members) if one, or the leader, offered
        a `failure`."""
        payloads = [own] + [self._wait(self._key(version, bucket, "payload", r)) for r in range(1, self.size)]
        failed = [p.removeprefix(_FAILED) for p in payloads if p.startswith(_FAILED)]
        if failed:
            self.announce(version, bucket, failed[0])
            raise HandleGroupError(f"a trainer rank could not stage its weights: {failed[0]}")
        return payloads

    def announce(self, version: str, bucket: int, error: str | None = None) -> None:
        """Tell every member the engine has taken `bucket` (error None) or why it did not."""
        for rank in range(1, self.size):
            self.store.set(self._key(version, bucket, "done", rank), "ok" if error is None else _FAILED + error)

    # -- a member ----------------------------------------------------------------------------

    def offer(self, version: str, bucket: int, payload: str) -> None:
        """Hand the leader this rank's payload for `bucket` (or `failure(why)` when it could not
        stage it), then wait until the engine has it: the staging buffer is free again after."""
        self.store.set(self._key(version, bucket, "payload", self.position), payload)
        answer = self._wait(self._key(version, bucket, "done", self.position))
        if answer.startswith(_FAILED):
            raise HandleGroupError(answer.removeprefix(_FAILED))

    @staticmethod
    def failure(error: str) -> str:
        """What a rank offers (or the leader collects as its own) for a bucket it could not stage:
        the leader then stops the engine's push instead of posting, and tells every member."""
        return _FAILED + error
