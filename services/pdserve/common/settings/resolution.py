"""Settings from this process's sources, flag > environment > config file > default (read in
`setting_sources.py`), and back: the flags and environment that give a child process the same."""
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

from pdserve.common import config_options as cv
from pdserve.common.setting_sources import build_section, resolve_sources
from pdserve.common.settings.router import RouterSettings
from pdserve.common.settings.worker import POD_NAME_ENV, WorkerSettings

T = TypeVar("T")


def _resolve_one(cls: type[T], prog: str, argv: Sequence[str] | None,
                 environ: Mapping[str, str] | None) -> T:
    options = cv.options_of(cls, "")
    values, labels = resolve_sources(prog, options, argv, environ)
    return build_section(cls, "", options, values, labels)


def resolve_worker_settings(argv: Sequence[str] | None = None,
                            environ: Mapping[str, str] | None = None) -> WorkerSettings:
    """`pdserve worker`'s settings. `environ` None reads the process environment.
    Raises ConfigError for a bad value; exits (argparse) on an unknown flag or --help."""
    settings = _resolve_one(WorkerSettings, "pdserve worker", argv, environ)
    pod = pod_name(environ)
    if settings.worker_id is None and settings.tls_dir is None and pod:
        # With TLS the certificate names the worker, the pod its instance (`worker/__main__.py`).
        return dataclasses.replace(settings, worker_id=pod)
    return settings


def pod_name(environ: Mapping[str, str] | None = None) -> str | None:
    """The Kubernetes pod this process runs in (`POD_NAME`, from the downward API), if any."""
    return (os.environ if environ is None else environ).get(POD_NAME_ENV) or None


def resolve_router_settings(argv: Sequence[str] | None = None,
                            environ: Mapping[str, str] | None = None) -> RouterSettings:
    """`pdserve router`'s settings; as `resolve_worker_settings`."""
    return _resolve_one(RouterSettings, "pdserve router", argv, environ)


def to_argv(settings: WorkerSettings | RouterSettings) -> list[str]:
    """Flags that resolve back to `settings`, with `child_environ(settings)` for its secrets
    (a field left None is passed as '', which unsets it)."""
    argv = []
    for o in cv.options_of(type(settings), ""):
        value = getattr(settings, o.targets[0][1])
        if o.is_secret:
            continue
        if value is None:
            argv += [f"--{o.flag}", ""]
        elif o.is_list:
            argv += [arg for item in value for arg in (f"--{o.flag}", item)]
        elif o.is_bool:
            argv.append(f"--{o.flag}" if value else f"--no-{o.flag}")
        else:
            argv += [f"--{o.flag}", str(value)]
    return argv


def child_environ(settings: WorkerSettings | RouterSettings | None = None) -> dict[str, str]:
    """This process's environment without its PDSERVE_ variables, for a child that gets
    every setting as a flag (a serve config file's keys would be unknown to a worker), plus
    `settings`' secrets, which `to_argv` leaves out (a command line is world-readable). Without
    POD_NAME: serve's workers in one pod would all take the pod's name as their id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(cv.ENV_PREFIX) and k != POD_NAME_ENV}
    for o in cv.options_of(type(settings), "") if settings is not None else ():
        value = getattr(settings, o.targets[0][1])
        if o.is_secret and value:
            env[o.env_var] = ",".join(value)
    return env
