"""The `pdserve` console script: one subcommand per process kind.

Each subcommand's module is imported only when chosen, so `pdserve router` never
imports torch and `pdserve bench` needs nothing of the server.
"""
import importlib
import sys

SUBCOMMANDS = {
    "serve": ("pdserve.serve.launcher", "main", "start router and workers as separate processes"),
    "router": ("pdserve.router.__main__", "main", "run the HTTP router"),
    "worker": ("pdserve.worker.__main__", "main", "run one worker (role prefill|decode|both)"),
    "bench": ("pdserve.bench.cli", "main", "load-test an OpenAI-compatible endpoint"),
    "certs": ("pdserve.serve.certs", "main", "make certificates for the internal gRPC plane (mutual TLS)"),
}


def _usage() -> str:
    lines = ["usage: pdserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, _, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"pdserve: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func, _ = SUBCOMMANDS[name]
    if name == "worker":  # before torch loads: OpenMP reads its settings once, at load
        from pdserve.common.settings import apply_worker_runtime_defaults
        apply_worker_runtime_defaults()
    module = importlib.import_module(module_name)
    return int(getattr(module, func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
