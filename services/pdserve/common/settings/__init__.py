"""Every setting of every pdserve process, resolved in this one package.

Each field has a flag, an environment variable and a config-file key, all spelled after the
flag: `--max-model-len`, `PDSERVE_MAX_MODEL_LEN`, `max-model-len:` (or `max_model_len:`).
Precedence, highest first: flag > environment variable > file named by `--config` (or
`PDSERVE_CONFIG`; YAML, TOML or JSON) > the field's default. Flags take vLLM's names where
the meaning is the same. A bad value raises ConfigError naming where it came from, e.g.
`PDSERVE_BLOCK_SIZE='12': must be a power of two`. The sources are read in
`setting_sources.py`; no module beyond it and this package reads the environment.
`pdserve serve`'s settings (a router and its workers) are built from these in `serve/settings.py`.

    options      what every settings dataclass is made of: `opt` fields, the options a worker
                 and a router share, the checks of their `__post_init__`
    worker       `WorkerSettings`, and the runtime environment a worker sets before torch loads
    router       `RouterSettings`
    resolution   settings from this process's flags, environment and file; back to a child's
                 flags and environment
"""
from pdserve.common.settings.options import check, check_positive, default_cache_dir, opt
from pdserve.common.settings.resolution import (child_environ, pod_name, resolve_router_settings,
                                                resolve_worker_settings, to_argv)
from pdserve.common.settings.router import ROUTING_POLICIES, TOOL_CALL_PARSER_NAMES, RouterSettings
from pdserve.common.settings.worker import KERNEL_CHOICES, WorkerSettings, apply_worker_runtime_defaults, usable_cores

__all__ = [
    "KERNEL_CHOICES", "ROUTING_POLICIES", "TOOL_CALL_PARSER_NAMES", "RouterSettings", "WorkerSettings",
    "apply_worker_runtime_defaults", "check", "check_positive", "child_environ", "default_cache_dir", "opt",
    "pod_name", "resolve_router_settings", "resolve_worker_settings", "to_argv", "usable_cores",
]
