"""Who may call what on a worker's gRPC server over mutual TLS: the roles allowed each method
(`POLICY`, the one place this is decided), checked by `RolePolicy` before the handler runs.

A caller's role is its certificate's (`pki.role_of`). A method absent from the table is refused
to everyone, so a new service is closed until the table names its callers. Refusal is
PERMISSION_DENIED (the client reads it as `PermissionDeniedError`) and the handler never sees
the call. A call without a client certificate can only have come in on a plain-text port
(`--insecure-internal`; a TLS port requires one): no roles there, nothing is checked.

- the router calls everything on the Worker, LoraAdapters and KvEvents services;
- a probe (health checks with a client certificate, `rpc/probe.py`) only `Worker.Health` and
  `Worker.GetInfo`, the two that say whether a worker serves and for which deployment;
- a decode worker only the KvTransfer service, which only a prefill worker serves (an
  aggregated worker, role both, prefills itself and never calls it);
- grpc.health.v1 answers every certificate of the authority.
"""
import functools
import inspect
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2

from pdserve.common.errors import PermissionDeniedError
from pdserve.common.pki import Role, role_of
from pdserve.rpc.gen import kv_events_pb2, kv_transfer_pb2, worker_pb2
from pdserve.rpc.status import status_of

ROUTER = frozenset({Role.ROUTER})
EVERY_ROLE = frozenset(Role)


def _service(descriptor, methods: Mapping[str, frozenset[Role]]) -> dict[str, frozenset[Role]]:
    """`methods` by their full path, "/pdserve.v1.Worker/Generate"; KeyError for a name the
    service does not have, so the table cannot drift from the protos unnoticed."""
    unknown = set(methods) - set(descriptor.methods_by_name)
    if unknown:
        raise KeyError(f"{descriptor.full_name} has no method {', '.join(sorted(unknown))}")
    return {f"/{descriptor.full_name}/{name}": roles for name, roles in methods.items()}


POLICY: dict[str, frozenset[Role]] = {
    **_service(worker_pb2.DESCRIPTOR.services_by_name["Worker"], {
        "Generate": ROUTER, "StreamOutputs": ROUTER, "Abort": ROUTER, "GetStats": ROUTER,
        "CheckKvIntegrity": ROUTER,
        "Health": frozenset({Role.ROUTER, Role.PROBE}), "GetInfo": frozenset({Role.ROUTER, Role.PROBE}),
    }),
    **_service(worker_pb2.DESCRIPTOR.services_by_name["LoraAdapters"], {
        "LoadLoraAdapter": ROUTER, "UnloadLoraAdapter": ROUTER,
    }),
    **_service(kv_events_pb2.DESCRIPTOR.services_by_name["KvEvents"], {"Subscribe": ROUTER, "Snapshot": ROUTER}),
    **_service(kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"], {
        "Handshake": frozenset({Role.DECODE}), "Prefill": frozenset({Role.DECODE}),
    }),
    **_service(health_pb2.DESCRIPTOR.services_by_name["Health"], {
        "Check": EVERY_ROLE, "Watch": EVERY_ROLE, "List": EVERY_ROLE,
    }),
}


@functools.lru_cache(maxsize=256)
def _role_of(cert_pem: bytes) -> Role | None:
    """The role a caller's verified certificate names (None: none), parsed once per
    certificate, not once per call."""
    try:
        return role_of(cert_pem)
    except ValueError:
        return None


class RolePolicy(grpc.aio.ServerInterceptor):
    """Refuses a call whose caller's role `POLICY` does not allow for its method."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED
            return None
        return _guarded(handler, details.method, POLICY.get(details.method, frozenset()))


async def _check(context: grpc.aio.ServicerContext, method: str, allowed: frozenset[Role]) -> None:
    auth = context.auth_context()
    certs = auth.get("x509_pem_cert")
    if not certs:  # plain text
        return
    role = _role_of(certs[0])
    if role in allowed:
        return
    callers = ", ".join(sorted(allowed)) or "no one"
    names = auth.get("x509_common_name") or (b"?",)
    error = PermissionDeniedError(f"{method} is open to {callers}; the caller {names[0].decode()!r} has "
                                  f"role {role.value if role else 'none'!r}")
    code, details, metadata = status_of(error)
    await context.abort(code, details, trailing_metadata=metadata)


def _guard(behavior: Callable, method: str, allowed: frozenset[Role]) -> Callable:
    """`behavior` run only after `_check`, of the same kind (grpc calls an async generator
    and a coroutine differently)."""
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request_or_iterator, context):
            await _check(context, method, allowed)
            async for response in behavior(request_or_iterator, context):
                yield response
        return guarded_stream

    async def guarded(request_or_iterator, context):  # every servicer of ours is async
        await _check(context, method, allowed)
        return await behavior(request_or_iterator, context)
    return guarded


def _guarded(handler: grpc.RpcMethodHandler, method: str, allowed: frozenset[Role]) -> grpc.RpcMethodHandler:
    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_guard(handler.unary_unary, method, allowed), **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_guard(handler.unary_stream, method, allowed), **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_guard(handler.stream_unary, method, allowed), **serializers)
    return grpc.stream_stream_rpc_method_handler(_guard(handler.stream_stream, method, allowed), **serializers)
