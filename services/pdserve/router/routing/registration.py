"""What a worker must share with the router and with every other worker to be routed to.

The router computes prompt block keys itself and looks them up in the workers' events, so a
worker with another model, block size or block-key algorithm would never match: a silent
zero hit rate. Such a worker is refused by name, at start an error, later a logged refusal.

A router with a deployment id admits only workers started with the same one: another launch's
worker at an address this router was given (a second `pdserve serve` on the host, a stale
process) would otherwise serve this router's clients. Such a worker is a logged refusal, at
start too (the router starts on its other workers). A router without one admits any worker.
"""
from collections.abc import Mapping

from pdserve.common.errors import ConfigError
from pdserve.common.ids import DeploymentId, WorkerId
from pdserve.common.stats import ModelInfo, WorkerRole

SHARED_FIELDS = ("model_name", "tokens_per_block", "block_hash_algorithm")
DECODE_ROLES = frozenset({WorkerRole.DECODE, WorkerRole.BOTH})


def check_deployment(address: WorkerId, reported: DeploymentId | None, expected: DeploymentId | None) -> None:
    """Raise ConfigError if the router has a deployment id (`expected`) and the worker another, or none."""
    if expected is not None and reported != expected:
        raise ConfigError(f"worker {address} deployment_id", reported or "",
                          f"this router admits only workers of deployment {expected!r}")


def check_worker(address: WorkerId, info: ModelInfo, hash_algorithm: str,
                 reference: tuple[WorkerId, ModelInfo] | None) -> None:
    """Raise ConfigError naming the worker and the field if `info` cannot join.

    `reference` is another worker already admitted (its address and info), None for the first."""
    if info.block_hash_algorithm != hash_algorithm:
        raise ConfigError(f"worker {address} block_hash_algorithm", info.block_hash_algorithm,
                          f"this router computes block keys with {hash_algorithm!r}")
    if reference is None:
        return
    ref_address, ref_info = reference
    for name in SHARED_FIELDS:
        value = getattr(info, name)
        if value != getattr(ref_info, name):
            raise ConfigError(f"worker {address} {name}", value,
                              f"differs from worker {ref_address}'s {getattr(ref_info, name)!r}")


def check_all(infos: Mapping[WorkerId, ModelInfo], hash_algorithm: str) -> None:
    """`check_worker` for each worker against the first (in address order)."""
    reference: tuple[WorkerId, ModelInfo] | None = None
    for address in sorted(infos):
        check_worker(address, infos[address], hash_algorithm, reference)
        reference = reference or (address, infos[address])


def cluster_info(infos: Mapping[WorkerId, ModelInfo]) -> ModelInfo:
    """What the HTTP API serves: the shared model, the shortest context any worker allows."""
    first = infos[min(infos)]
    return ModelInfo(model_name=first.model_name, max_model_len=min(i.max_model_len for i in infos.values()),
                     tokens_per_block=first.tokens_per_block, block_hash_algorithm=first.block_hash_algorithm,
                     role=WorkerRole.BOTH, vocab_size=first.vocab_size, eos_token_ids=first.eos_token_ids)
