"""`pact-ingress` command line: argument parsing only; the work is in the modules it calls.

Each subcommand parses its arguments and hands a loaded config to the module that does
the work. Expected failures (`PactIngressError`) become one stderr line each and exit
code 2 (usage/config) or 1 (runtime); tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pact_ingress import __version__
from pact_ingress.errors import UNPRINTABLE, ConfigError, PactIngressError, UsageError


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pact_ingress.identity import cert_path_for, keygen

    out = Path(args.output)
    # the certificate beside the key is written too: a node.crt already there may be the
    # node's own certificate, so it is no more ours to replace than the key is
    for path in (out, cert_path_for(out)):
        if os.path.lexists(path) and not args.force:
            raise PactIngressError(f"{path}: exists (use --force to overwrite)")
    try:
        ident = keygen(out, ed25519_key=args.ed25519)
    except OSError as exc:
        raise PactIngressError(f"{out}: cannot write the key or its certificate: "
                               f"{exc.strerror or exc}") from None
    print(ident.fingerprint)
    print(f"key: {ident.key_path} (0600)  cert: {ident.cert_path}", file=sys.stderr)
    return 0


def _cmd_fingerprint(args: argparse.Namespace) -> int:
    from pact_ingress.identity import fingerprint_file

    print(fingerprint_file(Path(args.file)))
    return 0


def _cmd_check_config(args: argparse.Namespace) -> int:
    from pact_ingress.config import load_config

    cfg = load_config(Path(args.config))
    routes = cfg.routes()
    print(f"{args.config}: ok ({len(cfg.tenants)} tenants, {len(routes)} routes)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from pact_ingress import stopping

    # loading what `serve` runs on takes most of a second: a reload or a stop signal that
    # comes meanwhile is noted for the start-up, not the default action's death
    stopping.hold_hup()
    stopping.guard(note_early=True)
    from pact_ingress import app

    return app.main_serve(Path(args.config), log_format=args.log_format or "json",
                          workers=args.workers)


def _sighup_changes_nothing(signum: int, frame: object) -> None:
    pass


def _cmd_connect(args: argparse.Namespace) -> int:
    # SIGHUP changes nothing for the connector (it logs so while it runs): caught from
    # here, it can neither kill it while it starts nor while SIGTERM's drain runs, when
    # no handler of trio's is there to catch it. Caught by a handler that does nothing
    # rather than ignored: exec resets a caught signal to its default, while an ignored
    # one stays ignored in the mail hook's commands.
    signal.signal(signal.SIGHUP, _sighup_changes_nothing)
    from pact_ingress import app

    return app.main_connect(Path(args.config), log_format=args.log_format or "json")


def _cmd_demo(args: argparse.Namespace) -> int:
    from pact_ingress import demo

    return demo.main(log_format=args.log_format or "text", base_port=args.port)


def _cmd_tenant(args: argparse.Namespace) -> int:
    from pact_ingress import tenants

    cfg = Path(args.config)
    if args.action == "add":
        if not args.host:
            raise ConfigError("tenant add needs --host")
        added = tenants.add_tenant(cfg, args.name, args.host, mode=args.mode, pin=args.pin,
                                   backend=args.backend)
        print(added.render())
    elif args.action == "list":
        listed = tenants.list_tenants(cfg)
        if args.name is not None:  # one tenant's line; a name that is not there is a slip
            listed = [t for t in listed if t.name == args.name]
            if not listed:
                raise UsageError(f"no tenant named {args.name!r} in {cfg}")
        for t in listed:
            hosts = ", ".join(f"{r.host} ({r.mode} → {r.backend})" for r in t.routes)
            print(f"{t.name}\tpins={','.join(t.pins)}\t{hosts}")
    else:
        if not args.name:
            raise ConfigError("tenant remove needs NAME")
        path = tenants.remove_tenant(cfg, args.name)
        print(f"removed {path}; reload the ingress: systemctl reload pact-ingress")
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from pact_ingress import certs_cli

    return certs_cli.main(Path(args.config), args.action, args.host)


def _cmd_status(args: argparse.Namespace) -> int:
    from pact_ingress.admin.client import fetch_status, format_status
    from pact_ingress.config import load_config

    cfg = load_config(Path(args.config))
    if cfg.listen.admin is None:
        raise ConfigError(f"{args.config}: listen.admin is not set; no admin endpoint to ask")
    from pact_ingress.admin.token import read_admin_token

    data = fetch_status(cfg.listen.admin, token=read_admin_token(cfg))
    print(format_status(data))
    return 0


def _cmd_relay(args: argparse.Namespace) -> int:
    import sqlite3
    import time

    from pact_ingress.config import load_config
    from pact_ingress.identity import is_pin
    from pact_ingress.relay.store import inspect, purge_file

    cfg = load_config(Path(args.config))
    if cfg.relay is None:
        raise ConfigError(f"{args.config}: no relay block; there is no relay queue")
    if args.recipient is not None and not is_pin(args.recipient):
        # a mistyped pin would match no queue: "purged 0" would read as success
        raise UsageError(f"--recipient {args.recipient!r} is not a pin (sha256: + 43 "
                         "base64url characters)")
    if cfg.state.backend == "redis":
        raise PactIngressError(f"{args.config}: the relay queue is in Redis (state.backend: "
                               "redis); `relay` reads the embedded store only: use redis-cli")
    store = cfg.relay.store
    if not store.exists():
        raise PactIngressError(f"{store}: no relay store yet (serve creates it)")
    tenants = cfg.relay_recipients()
    try:
        if args.action == "ls":
            rows = inspect(store, time.time())
            print("tenant\trecipient\titems\tbytes\toldest (UTC)\texpired\tallowlist")
            for r in rows:
                oldest = "-" if r["oldest"] is None else time.strftime(
                    "%Y-%m-%d %H:%M:%S", time.gmtime(r["oldest"]))
                print(f"{tenants.get(r['recipient'], '(not served)')}\t{r['recipient']}\t"
                      f"{r['items']}\t{r['bytes']}\t{oldest}\t{r['expired']}\t"
                      f"{r['allowlist']}")
            return 0
        if args.all and not args.recipient and not args.everyone:
            raise ConfigError("relay purge --all drops queued mail: name --recipient PIN, "
                              "or say --everyone")
        n = purge_file(store, time.time(), recipient=args.recipient, everything=args.all)
    except sqlite3.Error as exc:
        raise PactIngressError(f"{store}: {exc}") from exc
    what = "queued" if args.all else "expired"
    print(f"purged {n} {what} items; the running ingress recounts within a minute")
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pact-ingress", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"pact-ingress {__version__}")
    p.add_argument("--log-format", choices=("json", "text"), default=None,
                   help="log line format (default: one JSON object per line; text for demo)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def cmd(name: str, fn: Callable[[argparse.Namespace], int], help_: str,
            config: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        if config:
            sp.add_argument("-c", "--config", required=True, help="config file (YAML)")
        sp.set_defaults(func=fn)
        return sp

    sv = cmd("serve", _cmd_serve, "run the ingress (SIGHUP reloads, SIGTERM drains)")
    sv.add_argument("--workers", type=_positive, default=None, metavar="N",
                    help="processes for TLS-terminating work (default: one per usable "
                    "core; 1: everything in this one process)")
    cmd("connect", _cmd_connect, "run the home-side tunnel connector")
    demo = cmd("demo", _cmd_demo, "run ingress + demo node + connector on loopback",
               config=False)
    demo.add_argument("--port", type=int, default=8443, help="first loopback port to use")
    kg = cmd("keygen", _cmd_keygen, "new identity key (0600) + self-signed cert",
             config=False)
    kg.add_argument("--ed25519", action="store_true", help="Ed25519 instead of ECDSA P-256")
    kg.add_argument("-o", "--output", required=True, help="key file to write")
    kg.add_argument("--force", action="store_true", help="overwrite an existing key")
    fp = cmd("fingerprint", _cmd_fingerprint, "print sha256:… of a key, cert or SPKI file",
             config=False)
    fp.add_argument("file")
    cmd("check-config", _cmd_check_config, "validate a config file")
    tn = cmd("tenant", _cmd_tenant, "add, list or remove tenants (tenants.d/NAME.yaml)")
    tn.add_argument("action", choices=("add", "list", "remove"))
    tn.add_argument("name", nargs="?")
    tn.add_argument("--host")
    tn.add_argument("--mode", choices=("passthrough", "terminate"), default="passthrough")
    tn.add_argument("--pin")
    tn.add_argument("--backend", default="tunnel")
    ce = cmd("certs", _cmd_certs, "certificate inventory and forced renewal")
    ce.add_argument("action", choices=("list", "renew"))
    ce.add_argument("host", nargs="?")
    cmd("status", _cmd_status, "ask the running instance for routes, tunnels, certs")
    rl = cmd("relay", _cmd_relay, "relay queues: ls (depths), purge (expired, or --all)")
    rl.add_argument("action", choices=("ls", "purge"))
    rl.add_argument("--recipient", help="purge only this recipient's queue (sha256:…)")
    rl.add_argument("--all", action="store_true",
                    help="purge queued items too, not only expired ones")
    rl.add_argument("--everyone", action="store_true",
                    help="with --all and no --recipient: every recipient's queue")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "tenant" and args.action in ("add", "remove") and not args.name:
        parser.error(f"tenant {args.action} needs NAME")
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, while we can still handle it
        return code
    except BrokenPipeError:
        return _reader_went_away()
    except ConfigError as exc:
        for line in exc.messages:
            print(line, file=sys.stderr)
        return 2
    except PactIngressError as exc:  # a path in it may hold control characters
        print(f"pact-ingress: {str(exc).translate(UNPRINTABLE)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _reader_went_away() -> int:
    """stdout's reader closed the pipe (`pact-ingress status | head -1`): that ends the
    output, it is no fault of ours. Point stdout at /dev/null so the interpreter's last
    flush does not fail again, and exit as a tool killed by SIGPIPE would (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE
