"""Certificates for the internal plane: a throwaway set per `pdserve serve` launch, and
`pdserve certs` for deployments (docker-compose's generator service, a Kubernetes Secret).

`pdserve certs --out DIR --router router --prefill NAME[=HOST,...] --decode NAME[=HOST,...] ...`
writes the authority (`DIR/ca.crt`, `DIR/ca.key`) and one TLS folder per identity
(`DIR/NAME/{ca.crt,tls.crt,tls.key}`), its certificate in the role of the flag that names it
(`--router`, `--prefill`, `--decode`, `--both` for an aggregated worker, `--probe` for health
checks) and valid for its hosts and loopback. Run again on the same DIR, it keeps the authority
and replaces the named identities' certificates (rotation without a change of trust); a new
DIR is a new authority (rotate it by restarting every process with the new folders).
"""
import argparse
import dataclasses
import re
import socket
import sys
from pathlib import Path

from pdserve.common import pki
from pdserve.common.settings import WorkerSettings
from pdserve.serve.settings import ServeSettings

ROUTER_IDENTITY = "router"
_IDENTITY = re.compile(r"^[A-Za-z0-9@:._-]{1,64}$")
_ROLE_HELP = {
    pki.Role.ROUTER: "a router's identity (e.g. 'router')",
    pki.Role.PREFILL: "a prefill worker's identity (its worker id)",
    pki.Role.DECODE: "a decode worker's identity (its worker id)",
    pki.Role.BOTH: "an aggregated worker's identity (--role both; its worker id)",
    pki.Role.PROBE: "a health checker's identity (it may ask a worker only Health and GetInfo)",
}


def with_serve_certs(settings: ServeSettings, folder: Path) -> ServeSettings:
    """`settings` with a TLS folder under `folder` for the router and each worker, issued by a
    fresh authority whose key is never written (nothing else can join this launch). A worker's
    identity is its worker id, its certificate's role its `--role`."""
    authority = pki.Authority.create(f"pdserve serve {settings.router.deployment_id}")
    router_hosts = (_dialled_host(settings.router.host),)
    issued = authority.issue(ROUTER_IDENTITY, pki.Role.ROUTER, router_hosts)
    router = dataclasses.replace(settings.router, tls_dir=str(issued.write(folder / ROUTER_IDENTITY)))
    workers = tuple(_with_cert(authority, worker, folder / f"worker-{i}") for i, worker in enumerate(settings.workers))
    return dataclasses.replace(settings, router=router, workers=workers)


def _with_cert(authority: pki.Authority, worker: WorkerSettings, folder: Path) -> WorkerSettings:
    issued = authority.issue(worker.peer_name, pki.Role(worker.role), (_dialled_host(worker.host),))
    return dataclasses.replace(worker, tls_dir=str(issued.write(folder)), worker_id=worker.peer_name)


def _dialled_host(host: str) -> str:
    """The name others dial a process listening on `host` by."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def _identity(spec: str) -> tuple[str, tuple[str, ...]]:
    """"decode-0=decode,10.0.0.7" -> ("decode-0", ("decode", "10.0.0.7"))."""
    name, _, hosts = spec.partition("=")
    if not _IDENTITY.match(name):
        raise argparse.ArgumentTypeError(f"{name!r}: an identity is 1-64 of A-Z a-z 0-9 @ : . _ -")
    named = tuple(h for h in hosts.split(",") if h)
    internal = [h for h in named if pki.is_internal_name(h)]
    if internal:
        raise argparse.ArgumentTypeError(f"{internal[0]!r}: the names under {pki.INTERNAL_DOMAIN} are given by roles")
    return name, named


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder of the authority and the identities' TLS folders")
    for role, help_text in _ROLE_HELP.items():
        parser.add_argument(f"--{role}", action="append", default=[], type=_identity, metavar="NAME[=HOST,...]",
                            help=f"{help_text}, and the hosts it is dialled at (repeat for more)")
    parser.add_argument("--days", type=int, default=pki.DEFAULT_VALID_DAYS, help="validity of new certificates")
    parser.add_argument("--identity", action="append", default=[], help=argparse.SUPPRESS)  # before roles
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.identity:
        parser.error("--identity gave no role: name each identity by its role's flag instead, --router, "
                     "--prefill, --decode, --both or --probe NAME[=HOST,...]")
    wanted = [(role, name, hosts) for role in _ROLE_HELP for name, hosts in getattr(args, role)]
    if not wanted:
        parser.error("name at least one identity: --router, --prefill, --decode, --both or --probe NAME[=HOST,...]")
    names = [name for _, name, _ in wanted]
    if len(set(names)) < len(names):
        parser.error("an identity is named twice: each has one folder, one certificate and one role")
    out = Path(args.out)
    if (out / pki.CA_KEY).exists():
        authority = pki.Authority.load(out)
        print(f"pdserve certs: using the authority in {out}")
    else:
        authority = pki.Authority.create(f"pdserve {out.resolve().name}", args.days)
        authority.save(out)
        print(f"pdserve certs: new authority in {out} (keep {out / pki.CA_KEY} secret)")
    for role, name, hosts in wanted:
        folder = authority.issue(name, role, hosts, args.days).write(out / name)
        print(f"pdserve certs: {name} ({role}) -> {folder} (hosts: {', '.join(hosts) or 'loopback only'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
