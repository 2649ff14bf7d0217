"""``RedisCluster``: three embedded servers (``embedded.RedisServer``) in cluster mode on
loopback, joined here (slots, config epochs, ``CLUSTER MEET``) so no ``redis-cli`` is needed.
For benchmarks and tests of the cluster path; like every embedded server, each node dies with
this process."""

from __future__ import annotations

import time
from types import TracebackType

from remote_tier.embedded import HOST, RedisServer, ServerBinary, find_server

_SLOTS = 16384  # hash slots of a Redis Cluster


class RedisCluster:
    """Three cluster-mode server nodes on loopback joined into one cluster (no replicas);
    ``url`` names the first node."""

    def __init__(self, num_nodes: int = 3, *, binary: ServerBinary | None = None) -> None:
        if num_nodes < 3:
            raise ValueError(f"a redis cluster needs at least 3 primaries, got {num_nodes}")
        self.nodes: list[RedisServer] = []
        self._num_nodes = num_nodes
        self.binary = binary or find_server()

    @property
    def url(self) -> str:
        """A startup node's URL."""
        return self.nodes[0].url

    def start(self, *, timeout_s: float = 30.0) -> RedisCluster:
        """Start the nodes, create the cluster and wait for ``cluster_state:ok`` everywhere."""
        try:
            for _ in range(self._num_nodes):
                args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
                args += ["--cluster-node-timeout", "2000"]
                node = RedisServer(extra_args=args, binary=self.binary)
                self.nodes.append(node.start())
            self._join()
            deadline = time.monotonic() + timeout_s
            while not all(self._ready(n) for n in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("redis cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise
        return self

    def _join(self) -> None:
        """What ``redis-cli --cluster create`` does for primaries: give each node a distinct
        config epoch (so that no epoch collision has to be resolved) and an even share of the
        slots, then introduce every node to the first."""
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            slots = [str(s) for s in range(i * _SLOTS // n, (i + 1) * _SLOTS // n)]
            for reply in (node.command("CLUSTER", "SET-CONFIG-EPOCH", str(i + 1)),
                          node.command("CLUSTER", "ADDSLOTS", *slots)):
                if not reply.startswith(b"+OK"):
                    raise RuntimeError(f"cluster setup of node {node.port} failed: {reply!r}")
        for node in self.nodes[1:]:
            reply = self.nodes[0].command("CLUSTER", "MEET", HOST, str(node.port))
            if not reply.startswith(b"+OK"):
                raise RuntimeError(f"CLUSTER MEET {node.port} failed: {reply!r}")

    def _ready(self, node: RedisServer) -> bool:
        info = node.command("CLUSTER", "INFO")
        return (b"cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}\r"
                .encode() in info and f"cluster_slots_ok:{_SLOTS}\r".encode() in info)

    def close(self) -> None:
        """Stop every node and remove their directories."""
        for node in self.nodes:
            node.close()
        self.nodes = []

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
