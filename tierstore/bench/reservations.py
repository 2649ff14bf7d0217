"""Reservation abuse (issue 19, finding 5): can one client hold the shared segment?

An in-process service with a ``--segment`` host segment; a victim stores values filling most
of it, then an attacker sends ``--big`` reservations of a quarter of the segment each and a
flood of ``--flood`` one-byte reservations, never committing. Run twice: without a token (one
open tenant; victim and attacker share the loopback address, so one principal) and with a
principals file of two tenants. Reports what the attacker held, how many victim values were
evicted or still readable, how the flood was answered, and the RSS growth of this process
(the service runs in it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from tierstore.bench._util import table
from tierstore.client import Client, ServiceError
from tierstore.config import StoreConfig
from tierstore.reference_model import tiny_layout
from tierstore.service.config import ServiceConfig
from tierstore.service.principals import hash_token, new_token
from tierstore.service.running import RunningService, free_port
from tierstore.settings import parse_size
from tierstore.store import TierStore

VALUE_BYTES = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--segment", default="256MiB", help="the storage API's host segment")
    parser.add_argument("--big", type=int, default=5,
                        help="reservations of a quarter of the segment each")
    parser.add_argument("--flood", type=int, default=5000, help="one-byte reservations")


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _attack(args: argparse.Namespace, segment: int, principals: bool, workdir: str
            ) -> dict[str, Any]:
    tokens = {"victim": new_token(), "attacker": new_token()}
    path = None
    if principals:
        path = os.path.join(workdir, "principals.json")
        with open(path, "w") as f:
            json.dump({"tenants": {name: {"tokens": [hash_token(t)], "namespaces": ["*"]}
                                   for name, t in tokens.items()}}, f)
    config = ServiceConfig(port=free_port(), kv_host_bytes=segment, principals=path)
    store = TierStore(tiny_layout(4), StoreConfig(capacity_bytes=1 << 20))
    num_values = segment * 9 // 10 // VALUE_BYTES  # too little room left for a quarter
    keys = [f"v{i}" for i in range(num_values)]
    with RunningService(store, config) as svc, \
            Client(svc.url, token=tokens["victim"] if principals else None, retries=0) as victim, \
            Client(svc.url, token=tokens["attacker"] if principals else None,
                   retries=0) as attacker:
        for i in range(0, num_values, 16):
            victim.batch_set(keys[i:i + 16], [bytes([j % 251]) * VALUE_BYTES
                                              for j in range(i, min(i + 16, num_values))], "ns")
        name = attacker.call("/v1/shm/attach", {})["segments"]["kv"]["name"]
        before = svc.service.kv.stats()["host_keys"]
        held = 0
        for _ in range(args.big):
            reply = attacker.call("/v1/storage/shm_reserve", {
                "keys": ["big"], "sizes": [segment // 4], "namespace": "ns", "segment": name})
            held += sum(slot[1] for slot in reply["slots"] if slot)
        evicted = before - svc.service.kv.stats()["host_keys"]
        readable = sum(v is not None for v in victim.batch_get(keys, "ns"))
        rss, granted, refused = _rss(), 0, 0
        for n in range(args.flood):
            try:
                attacker.call("/v1/storage/shm_reserve", {
                    "keys": [f"t{n}"], "sizes": [1], "namespace": "ns", "segment": name})
                granted += 1
            except ServiceError as exc:
                refused += exc.status == 429
        return {"mode": "principals" if principals else "open", "values": num_values,
                "held_mib": held / 2**20, "evicted": evicted, "readable": readable,
                "flood_granted": granted, "flood_refused_429": refused,
                "reservations_held": svc.service.kv.stats()["shm_reservations"],
                "rss_growth_mib": round((_rss() - rss) / 2**20, 1)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both modes; the figures."""
    segment = parse_size(args.segment)
    with tempfile.TemporaryDirectory(prefix="tierstore-reservations-") as workdir:
        rows = [_attack(args, segment, principals, workdir) for principals in (False, True)]
    return {"segment_mib": segment / 2**20, "big": args.big, "flood": args.flood, "rows": rows}


def render(result: dict[str, Any]) -> str:
    return (f"segment {result['segment_mib']:.0f} MiB, {result['big']} reservations of a "
            f"quarter each, then {result['flood']} one-byte ones\n"
            + table(result["rows"], ["mode", "values", "held_mib", "evicted", "readable",
                                     "flood_granted", "flood_refused_429",
                                     "reservations_held", "rss_growth_mib"]))
